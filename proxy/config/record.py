"""How a call becomes durable: the writer, the journal, durable mode, credit and AIR, the spans
(proxy/record/ reads these)."""

from __future__ import annotations

from pydantic import ByteSize, Field

from core import codecs
from core.settings import FlywheelSettings


class RecordSettings(FlywheelSettings):
    writer_batch_size: int = Field(500, ge=1, description="Most transitions per database write.")
    writer_linger_s: float = Field(
        0.05,
        ge=0,
        le=5,
        description="At low load, how long a recorded transition may wait for others to share "
        "its database write (one write costs about the same for 1 as for 10). Rewards, episode "
        "reads, durable mode and shutdown write at once; 0 writes every call on its own.",
    )
    writer_queue_max_bytes: ByteSize = Field(
        ByteSize(256 * 2**20),
        ge=1,
        description="Memory the writer's queue may hold (e.g. 256MiB) before it spills to the "
        "journal: a slow database must not get the proxy OOM-killed with its queue.",
    )
    writer_memo_max_bytes: ByteSize = Field(
        ByteSize(codecs.PROMPT_MEMO_BYTES),
        ge=0,
        description="Memory the writer's memo of each episode's last prompt may hold (its "
        "digests, so that the next call hashes only what is new); 0 turns it off.",
    )
    writer_memo_max_entries: int = Field(
        codecs.PROMPT_MEMO_ENTRIES,
        ge=0,
        description="Most episodes the writer's prompt memo keeps, the least recently used "
        "forgotten first, episodes of one call (no X-Episode-Id) before conversations.",
    )
    writer_write_timeout_s: float = Field(
        15.0,
        gt=0,
        description="A database write taking longer is an outage: its transitions go to the "
        "journal. Journal replays size their chunks to finish well within it.",
    )
    writer_pool_size: int = Field(
        4,
        ge=1,
        description="Database connections kept for the writer alone (recording, journal "
        "replays, rewards), up to as many again in bursts; readers (dashboard, episodes, export, "
        "admin) have a pool of their own, so no reader can make recording wait or spill to the "
        "journal.",
    )
    writer_unstored_max_ids: int = Field(
        50_000,
        ge=0,
        description="Journaled transitions the writer tracks one by one (~0.5 KB each) for "
        "rewards and episode reads; past it, a 1 MiB summary that may answer 'not stored yet' "
        "(a 503 to retry) until the journal is replayed.",
    )
    journal_retry_s: float = Field(
        1.0, gt=0, description="While Postgres is unreachable, how often a journal replay is tried."
    )
    journal_replay_chunk_bytes: ByteSize = Field(
        ByteSize(32 * 2**20),
        ge=1,
        description="Most transitions' memory (as FLYWHEEL_WRITER_QUEUE_MAX_BYTES counts it) "
        "replayed from the journal in one transaction; halved while writes are slow.",
    )
    reward_pool_size: int = Field(
        4,
        ge=1,
        description="Database connections for reward and demonstration posts, up to as many "
        "again in bursts: a pool of their own, so posts queued on one episode's row lock cannot "
        "take the writer's connections and make recording spill to the journal.",
    )
    durable: bool = Field(
        False,
        description="Release a successful answer only once its transitions are committed or "
        "fsync'd to the journal, so not even kill -9 loses an answered call (costs latency: "
        "docs/benchmarks.md, durable mode).",
    )
    durable_wait_s: float = Field(
        30.0,
        gt=0,
        description="Durable mode: release the answer anyway after this long (Postgres and the "
        "journal both failing), counted in flywheel_durable_timeouts_total.",
    )
    credit_gamma: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Discount for credit assignment; unset = identical assignment (paper default).",
    )
    air_penalty: float | None = Field(
        None,
        ge=0,
        description="Automatic intermediate rewards (proxy/record/air.py): a transition whose tool "
        "call names an undeclared tool, has non-JSON arguments or breaks the tool's schema gets an "
        "intermediate reward of minus this. Unset: AIR off (0: check and record, no penalty).",
    )
    air_tool_call_marker: str = Field(
        "<tool_call>",
        description="Text that starts a tool call in the served model's output (Hermes/Qwen: "
        "<tool_call>); seen with no call parsed, AIR counts an unparsed call. Empty: not checked.",
    )
    otel_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces): every recorded "
        "call is also exported as an OpenTelemetry span in its episode's trace "
        "(proxy/record/tracing.py). Unset: off.",
    )
    otel_service_name: str = Field("flywheel-proxy", description="The spans' service.name.")
