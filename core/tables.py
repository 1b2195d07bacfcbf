"""All tables, as SQLAlchemy 2.0 typed classes. Alembic migrations must match these.

Size matters here: a multi-turn episode repeats its history in every prompt. So
- chat messages live once each in `message` (content-addressed by a 16-byte BLAKE2b digest); a
  transition keeps only the list of digests of its prompt messages (a system prompt shared by
  millions of calls is stored once);
- token ids and logprobs are packed little-endian int32 / float32 `bytea` (4 bytes a token),
  stored without compression (`UNCOMPRESSED`, migration 0003): pglz saved nothing on them and
  cost a third of Postgres's CPU per recorded transition.

Kept in bounds: `transition` is partitioned by UTC day on `requested_at` (migration 0011;
`core/partitions.py` makes the days, `core/retention.py` drops old ones), and `message.last_used`
says until when a message may still be needed.
"""

from __future__ import annotations

import uuid
from datetime import date, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Sequence,
    SmallInteger,
    Text,
    UniqueConstraint,
    Uuid,
    func,
)
from sqlalchemy import (
    text as sql,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# A transition the trainer may still learn from: the partial index below, the trainer's queue
# (trainer/data/store.py) and what retention keeps (core/retention.py) say it in these words.
TRAINABLE = (
    "status = 'ok' AND credited_at IS NOT NULL AND trained_at IS NULL AND skip_reason IS NULL"
)

# transition columns with STORAGE EXTERNAL (SQLAlchemy has no word for it; a test checks them).
UNCOMPRESSED = ("prompt_token_ids", "completion_token_ids", "logprobs")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSONB,
        datetime: DateTime(timezone=True),
    }


class Episode(Base):
    """One run of an agent on one task. Rows appear with their first transition or reward."""

    __tablename__ = "episode"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    task_id: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    final_reward: Mapped[float | None] = mapped_column(Double)
    final_reward_at: Mapped[datetime | None]
    # Its newest call's requested_at (the writer moves it up); NULL: none recorded since 0011.
    last_call_at: Mapped[datetime | None]

    # The dashboard's episode list, newest first, a keyset page at a time.
    __table_args__ = (Index("ix_episode_created_at", "created_at", "id"),)


class Message(Base):
    """A prompt message (or a completions prompt), stored once however many prompts repeat it."""

    __tablename__ = "message"

    digest: Mapped[bytes] = mapped_column(LargeBinary, primary_key=True)
    body: Mapped[dict[str, Any]]
    # At least the UTC day of every transition that names it (the writer keeps it so): retention
    # deletes the messages last used before the oldest day it keeps.
    last_used: Mapped[date] = mapped_column(Date, server_default=func.current_date())


class TokenBlock(Base):
    """BLOCK_TOKENS of a prompt's token ids (core/codecs.py), stored once however many prompts
    begin with them: a conversation's earlier turns, a shared system prompt."""

    __tablename__ = "token_block"

    digest: Mapped[bytes] = mapped_column(LargeBinary, primary_key=True)
    ids: Mapped[bytes] = mapped_column(LargeBinary)  # packed like prompt_token_ids
    last_used: Mapped[date] = mapped_column(Date, server_default=func.current_date())  # as above


# A transition's whole prompt token ids (packed), its blocks joined back in order before the rest:
# what every reader selects instead of the column itself.
PROMPT_IDS_SQL = """(CASE WHEN {row}.prompt_blocks IS NULL THEN {row}.prompt_token_ids ELSE (
    SELECT string_agg(b.ids, ''::bytea ORDER BY d.ord)
    FROM unnest({row}.prompt_blocks) WITH ORDINALITY AS d(digest, ord)
    JOIN token_block b ON b.digest = d.digest
) || coalesce({row}.prompt_token_ids, ''::bytea) END)"""


class Transition(Base):
    """One choice of one completion call: (input_t, output_t) of the paper, plus its return.

    Partitioned by day on `requested_at`, so the primary key has to contain it; `id` alone is
    unique all the same (a uuid4 made by the proxy)."""

    __tablename__ = "transition"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True)
    # No foreign key (0011): the writer creates the episode in the same transaction, and
    # retention deletes one only with no call left; the check cost a probe of every partition
    # per deleted episode (and a lookup per recorded row).
    episode_id: Mapped[str] = mapped_column(Text)
    request_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    choice_index: Mapped[int] = mapped_column(SmallInteger)
    task_id: Mapped[str | None] = mapped_column(Text)
    agent_name: Mapped[str | None] = mapped_column(Text)
    requested_at: Mapped[datetime] = mapped_column(primary_key=True)
    route: Mapped[str] = mapped_column(Text)  # "chat" | "completions" | "responses"
    status: Mapped[str] = mapped_column(Text)  # "ok" | "aborted" | "failed"
    http_status: Mapped[int] = mapped_column(SmallInteger)
    model_requested: Mapped[str | None] = mapped_column(Text)
    model_used: Mapped[str | None] = mapped_column(Text)
    policy_version: Mapped[int | None] = mapped_column(Integer)
    # The lineage whose policy served it (core/policy.py); NULL: not the policy.
    lineage: Mapped[str | None] = mapped_column(Text)
    message_digests: Mapped[list[bytes]] = mapped_column(ARRAY(LargeBinary))
    params: Mapped[dict[str, Any]]  # the request minus messages/prompt
    # The prompt's token ids past its last whole block; the blocks are in `token_block`, named
    # in order by `prompt_blocks` (NULL: none, the prompt is all here). PROMPT_IDS_SQL joins them.
    prompt_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    prompt_blocks: Mapped[list[bytes] | None] = mapped_column(ARRAY(LargeBinary))
    completion_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)
    text: Mapped[str | None] = mapped_column(Text)
    tool_calls: Mapped[list[Any] | None] = mapped_column(JSONB)
    # What AIR found wrong with the tool calls (proxy/record/air.py); NULL: nothing, or AIR off.
    tool_errors: Mapped[list[Any] | None] = mapped_column(JSONB)
    finish_reason: Mapped[str | None] = mapped_column(Text)
    error: Mapped[dict[str, Any] | None]
    latency_ms: Mapped[float] = mapped_column(Double)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    # A routed call's provider (FLYWHEEL_ROUTES: "openai", "anthropic", ...) and litellm's price
    # of the call (on its first choice); NULL: served by vLLM.
    provider: Mapped[str | None] = mapped_column(Text)
    cost_usd: Mapped[float | None] = mapped_column(Double)
    return_: Mapped[float | None] = mapped_column("return", Double)
    credited_at: Mapped[datetime | None]
    trained_at: Mapped[datetime | None]
    trained_version: Mapped[int | None] = mapped_column(Integer)  # the adapter it went into
    # The trainer's lease: a claim that expires is taken over by the next trainer.
    claimed_by: Mapped[str | None] = mapped_column(Text)
    claim_expires_at: Mapped[datetime | None]
    # Why the trainer set a transition aside without training on it (missing ids, stale, ...).
    skip_reason: Mapped[str | None] = mapped_column(Text)
    # Claims that did not end in training; at the trainer's limit the row is set aside.
    train_attempts: Mapped[int] = mapped_column(SmallInteger, server_default=sql("0"))

    __table_args__ = (
        Index("ix_transition_episode_id", "episode_id", "requested_at"),
        Index("ix_transition_requested_at", "requested_at"),  # the dashboard's window
        # Per version over time: a canary's two arms (core/canary.py), reward per version.
        Index("ix_transition_policy_version", "policy_version", "requested_at"),
        # An agent's episodes (the dashboard's `agent=` filter: one that has none is a probe).
        Index("ix_transition_agent_name", "agent_name", "episode_id"),
        # The trainer's "oldest credited, untrained, trainable" scan reads only this small index.
        Index(
            "ix_transition_trainable",
            "credited_at",
            postgresql_where=sql(TRAINABLE),
        ),
        {"postgresql_partition_by": "RANGE (requested_at)"},
    )


class Reward(Base):
    """Every reward as posted: final (transition_id NULL) or intermediate (one step)."""

    __tablename__ = "reward"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episode.id"), index=True)
    # No foreign key: `transition` is partitioned (migration 0011); retention deletes the step
    # rewards of the transitions it drops.
    transition_id: Mapped[uuid.UUID | None] = mapped_column(Uuid, index=True)
    value: Mapped[float] = mapped_column(Double)
    # Who gave it: NULL (the application, unsaid), "air" (the proxy's own, proxy/record/air.py), or
    # what the client posted (e.g. "tool" for a tool run it saw fail).
    source: Mapped[str | None] = mapped_column(Text)
    # Unique per episode: a retry with the same key is answered "duplicate", stored once.
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # A step reward whose transition is not stored yet (another replica's writer has it): set
    # until the writer stores that transition and moves it to `transition_id`.
    pending_transition_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    pending_tool_call_id: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("episode_id", "idempotency_key"),
        Index(
            "ix_reward_pending",
            "episode_id",
            postgresql_where=sql(
                "pending_transition_id IS NOT NULL OR pending_tool_call_id IS NOT NULL"
            ),
        ),
    )


class AdapterVersion(Base):
    """A trained LoRA adapter; its lifecycle is `core/policy.py`; the proxy's alias follows
    `is_current`."""

    __tablename__ = "adapter_version"

    # Numbers come from one sequence for every lineage, so a number names one adapter anywhere
    # (a pin, X-Policy-Version, a transition's policy_version) and no two trainers share one.
    version: Mapped[int] = mapped_column(Integer, Sequence("adapter_version_seq"), primary_key=True)
    # e.g. "policy" (the default), "writer": each lineage has its own current version.
    lineage: Mapped[str] = mapped_column(Text, server_default=sql("'policy'"))
    name: Mapped[str] = mapped_column(Text, unique=True)  # "<lineage>-v<version>"
    path: Mapped[str] = mapped_column(Text)
    base_model: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    is_current: Mapped[bool] = mapped_column(Boolean, server_default=sql("false"))
    trained_transitions: Mapped[int] = mapped_column(Integer, server_default=sql("0"))
    stats: Mapped[dict[str, Any] | None]  # the training step's figures, for `adapters list`
    # Set before it is unloaded from every vLLM and its directory deleted (core/policy.py): a
    # retired version can never become current again.
    retired_at: Mapped[datetime | None]

    __table_args__ = (
        Index(  # one current version per lineage
            "uq_adapter_version_current",
            "lineage",
            unique=True,
            postgresql_where=sql("is_current"),
        ),
    )


class ApiKey(Base):
    """A tenant's API key, as its SHA-256 hash (core/tenants.py); revoked keys stay, marked."""

    __tablename__ = "api_key"

    id: Mapped[str] = mapped_column(Text, primary_key=True)  # the `fw_<id>_...` part
    tenant: Mapped[str] = mapped_column(Text)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    key_hash: Mapped[bytes] = mapped_column(LargeBinary)
    name: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    revoked_at: Mapped[datetime | None]


class Canary(Base):
    """A candidate version serving a fraction of its lineage's `policy` traffic until the reward
    decides (core/canary.py). Open while `decided_at` is NULL; one open canary per lineage. The
    decided rows are the record of every promotion and rollback, with their evidence."""

    __tablename__ = "canary"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    lineage: Mapped[str] = mapped_column(Text)
    candidate: Mapped[int] = mapped_column(ForeignKey("adapter_version.version"))
    baseline: Mapped[int] = mapped_column(Integer)  # the current version then (0: base model)
    fraction: Mapped[float] = mapped_column(Double)  # of the lineage's episodes
    rule: Mapped[dict[str, Any]]  # the decision's settings (core/canary.py `Rule`)
    opened_at: Mapped[datetime] = mapped_column(server_default=func.now())
    decided_at: Mapped[datetime | None]
    action: Mapped[str | None] = mapped_column(Text)  # promote | rollback | superseded
    reason: Mapped[str | None] = mapped_column(Text)
    # The evidence at the decision: rewarded episodes, mean reward and p-values of each arm.
    evidence: Mapped[dict[str, Any] | None]

    __table_args__ = (
        Index("uq_canary_open", "lineage", unique=True, postgresql_where=sql("decided_at IS NULL")),
    )


class LineagePin(Base):
    """A lineage held at one version by hand (core/policy.py `pin`): nothing is published to it
    and no canary opens on it until it is unpinned. Version 0: held on the base model."""

    __tablename__ = "lineage_pin"

    lineage: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    pinned_at: Mapped[datetime] = mapped_column(server_default=func.now())
    note: Mapped[str | None] = mapped_column(Text)  # why, for whoever looks later


class Judgement(Base):
    """The judge's work on one episode (judge/): a claim while it is being judged, then its score
    and rationale, which judge model gave them and what the group's call cost. The score also
    went to the proxy as the episode's final reward (source `judge`)."""

    __tablename__ = "judgement"

    episode_id: Mapped[str] = mapped_column(ForeignKey("episode.id"), primary_key=True)
    status: Mapped[str] = mapped_column(Text)  # claimed | judged | skipped | failed
    claimed_by: Mapped[str | None] = mapped_column(Text)
    claimed_until: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(SmallInteger, server_default=sql("0"))
    error: Mapped[str | None] = mapped_column(Text)  # the last failed attempt's
    score: Mapped[float | None] = mapped_column(Double)
    rationale: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(Text)
    # Episodes ranked together in one call share a group id, its size, tokens and cost.
    group_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    group_size: Mapped[int | None] = mapped_column(SmallInteger)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cost_usd: Mapped[float | None] = mapped_column(Double)  # None: litellm knew no price
    judged_at: Mapped[datetime | None]


class ProxyReplica(Base):
    """A running proxy, by its heartbeat: a tenant's quota is shared among those alive
    (proxy/quotas.py); a row whose heartbeat stopped is deleted by the next one to beat."""

    __tablename__ = "proxy_replica"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    started_at: Mapped[datetime] = mapped_column(server_default=func.now())
    heartbeat_at: Mapped[datetime] = mapped_column(server_default=func.now())


class Demonstration(Base):
    """A prompt with the answer it should get, for the trainer to imitate (a supervised step on
    the answer's tokens, trainer/learner/sft.py): posted by an application (a labelled set, a
    person's correction) as chat messages and an answer, or copied from a recorded call of a
    rewarded episode with its exact token ids (rejection-sampling fine-tuning). It trains one
    lineage."""

    __tablename__ = "demonstration"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True)
    lineage: Mapped[str] = mapped_column(Text)
    tenant: Mapped[str | None] = mapped_column(Text)  # NULL: the default tenant
    source: Mapped[str] = mapped_column(Text)  # "posted" | "episode"
    # Where it came from, stored as a call's tags are (a tenant's ids are `<tenant>/<id>`).
    episode_id: Mapped[str | None] = mapped_column(Text)
    task_id: Mapped[str | None] = mapped_column(Text)
    agent_name: Mapped[str | None] = mapped_column(Text)
    transition_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)  # the call it copies
    # Posted: the prompt's chat messages (and tools), the answer as an assistant message; the
    # trainer renders them with the model's chat template. Copied: the call's token ids.
    messages: Mapped[list[Any] | None] = mapped_column(JSONB)
    tools: Mapped[list[Any] | None] = mapped_column(JSONB)
    completion: Mapped[dict[str, Any] | None]
    prompt_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    completion_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # Training: how many epochs it went into, the last version it trained, the trainer's lease.
    epochs: Mapped[int] = mapped_column(SmallInteger, server_default=sql("0"))
    trained_at: Mapped[datetime | None]
    trained_version: Mapped[int | None] = mapped_column(Integer)
    claimed_by: Mapped[str | None] = mapped_column(Text)
    claim_expires_at: Mapped[datetime | None]
    train_attempts: Mapped[int] = mapped_column(SmallInteger, server_default=sql("0"))
    skip_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("lineage", "idempotency_key"),
        # The trainer's queue: a lineage's demonstrations by epochs trained, oldest first.
        Index("ix_demonstration_queue", "lineage", "epochs", "created_at"),
    )


class EvalSet(Base):
    """Prompts a lineage's every new version is asked at temperature 0 before it serves
    (trainer/evals.py), each with what its answer is scored against, and how (core/evals.py):
    `exact` (the answer's text is the reference, or one of them) or `python:module:function`.
    Small by design (hundreds of items), so its items are one JSONB array; `digest` names
    their content, so a score is compared only with a score on the same items."""

    __tablename__ = "eval_set"

    id: Mapped[int] = mapped_column(Integer, Identity(), primary_key=True)
    lineage: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)
    scorer: Mapped[str] = mapped_column(Text)
    # [{"messages": [...], "tools": [...] | null, "reference": any, "max_tokens": int | null}]
    items: Mapped[list[Any]] = mapped_column(JSONB)
    digest: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(Text)  # the file it was made from, for `eval list`
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())

    __table_args__ = (UniqueConstraint("lineage", "name"),)
