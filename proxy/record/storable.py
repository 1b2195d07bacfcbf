"""What Postgres cannot hold, made storable: a U+0000 in text or JSON becomes U+FFFD.

Only what is recorded is changed (a tiny model can sample it; a client may send it); what goes to
vLLM and back to the client is untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from core.record import TransitionRecord


def pg_safe(value: Any) -> Any:
    """`value` with every U+0000 made U+FFFD: Postgres text and jsonb cannot hold it."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [pg_safe(v) for v in value]
    if isinstance(value, dict):
        return {pg_safe(k): pg_safe(v) for k, v in value.items()}
    return value


def pg_safe_record(record: TransitionRecord) -> TransitionRecord:
    return TransitionRecord.from_json(pg_safe(dataclasses.asdict(record)))


def has_nul(record: TransitionRecord) -> bool:
    """Whether vLLM's side of a record (text, tool calls, error) holds a U+0000."""
    text, tool_calls, error = record.text, record.tool_calls, record.error
    return bool(
        (text and "\x00" in text)
        or (tool_calls and b"\\u0000" in orjson.dumps(tool_calls))
        or (error and b"\\u0000" in orjson.dumps(error))
    )
