"""One recorded transition as it travels: built by the proxy's forwarder, queued by the recorder,
written to the journal as a JSON line, and COPYed into `transition` by the store.

The fields are the `transition` table's recorded columns, in COPY order. Each field's metadata
names its column and Postgres type; `TRANSITION_COLUMNS` (the COPY column list) and `copy_row` are
derived from them, and tests/core/test_record.py fails when they and the table disagree. The columns
the record does not carry are set later: `return`/`credited_at` by credit assignment,
`trained_*`, the claim and `skip_reason` by the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

from core.codecs import PackedDigests, pack, packed_uuid


def _column(
    pg_type: str,
    *,
    column: str | None = None,
    encode: Callable[[Any], Any] | None = None,
    **kwargs: Any,
) -> Any:
    return dataclasses.field(
        metadata={"pg_type": pg_type, "column": column, "encode": encode}, **kwargs
    )


def _timestamp(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, UTC)


def _pack_ids(ids: list[int] | None) -> bytes | None:
    return pack(ids, "i")


def _pack_logprobs(logprobs: list[float] | None) -> bytes | None:
    return pack(logprobs, "f")


@dataclasses.dataclass(slots=True, kw_only=True)
class TransitionRecord:
    """One choice of one completion call: (input_t, output_t) of the paper, as recorded."""

    id: str = _column("uuid", encode=packed_uuid)
    episode_id: str = _column("text")
    request_id: str = _column("uuid", encode=packed_uuid)  # shared by the n choices of a call
    choice_index: int = _column("int2")
    task_id: str | None = _column("text", default=None)
    agent_name: str | None = _column("text", default=None)
    requested_at: float = _column("timestamptz", encode=_timestamp)  # unix seconds
    route: str = _column("text")  # a wire.Endpoint name: "chat" | "completions" | "responses"
    status: str = _column("text")  # "ok" | "aborted" | "failed"
    http_status: int = _column("int2")
    model_requested: str | None = _column("text", default=None)
    model_used: str | None = _column("text", default=None)
    policy_version: int | None = _column("int4", default=None)  # None: not the policy
    lineage: str | None = _column("text", default=None)  # whose policy served it (core/policy.py)
    # The prompt's messages (chat), [{"prompt": ...}] (completions) or instructions and input items
    # (responses), stored once each by digest.
    messages: list[Any] = _column("bytea[]", column="message_digests")
    params: dict[str, Any] = _column("jsonb", default_factory=dict)  # the request minus the prompt
    prompt_token_ids: list[int] | None = _column("bytea", default=None)  # the whole prompt
    # Not the record's to carry: the store splits the prompt's ids into content-addressed blocks
    # (core/codecs.py `split_blocks`) and writes their digests here, the rest in the column above.
    prompt_blocks: None = _column("bytea[]", default=None)
    completion_token_ids: list[int] | None = _column("bytea", encode=_pack_ids, default=None)
    logprobs: list[float] | None = _column("bytea", encode=_pack_logprobs, default=None)
    text: str | None = _column("text", default=None)
    tool_calls: list[Any] | None = _column("jsonb", default=None)
    tool_errors: list[Any] | None = _column("jsonb", default=None)  # proxy/record/air.py, when on
    finish_reason: str | None = _column("text", default=None)
    error: dict[str, Any] | None = _column("jsonb", default=None)
    latency_ms: float = _column("float8")
    prompt_tokens: int | None = _column("int4", default=None)
    completion_tokens: int | None = _column("int4", default=None)
    provider: str | None = _column("text", default=None)  # proxy/relay/providers.py
    cost_usd: float | None = _column("float8", default=None)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TransitionRecord:
        """A record read back from the journal. Lines written by another version of Flywheel
        replay too: a field they lack takes its default, one this version lacks is ignored."""
        return cls(**{k: v for k, v in data.items() if k in FIELD_NAMES})


_FIELDS = dataclasses.fields(TransitionRecord)
FIELD_NAMES = frozenset(f.name for f in _FIELDS)
# The COPY column list: (column, Postgres type), in the record's field order.
TRANSITION_COLUMNS = tuple((f.metadata["column"] or f.name, f.metadata["pg_type"]) for f in _FIELDS)

_values = attrgetter(*(f.name for f in _FIELDS))  # every field in one C call
_ENCODED = tuple((i, f.metadata["encode"]) for i, f in enumerate(_FIELDS) if f.metadata["encode"])
_POSITION = {f.name: i for i, f in enumerate(_FIELDS)}
_MESSAGES, _PROMPT_IDS = _POSITION["messages"], _POSITION["prompt_token_ids"]
_PROMPT_BLOCKS = _POSITION["prompt_blocks"]


def copy_row(
    record: TransitionRecord,
    message_digests: PackedDigests,
    prompt_blocks: PackedDigests | None,
    prompt_rest: bytes | None,
) -> tuple[Any, ...]:
    """The record as a COPY row in TRANSITION_COLUMNS order. The store packs the values that
    the n choices of one call share (their prompt: messages, token id blocks and the rest), once
    per call."""
    row = list(_values(record))
    for i, encode in _ENCODED:
        row[i] = encode(row[i])
    row[_MESSAGES] = message_digests
    row[_PROMPT_BLOCKS] = prompt_blocks
    row[_PROMPT_IDS] = prompt_rest
    return tuple(row)  # psycopg's COPY writes a tuple faster than a list
