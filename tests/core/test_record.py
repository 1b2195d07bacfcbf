"""The typed transition record against the `transition` table, and through the journal.

`TRANSITION_COLUMNS` (the writer's COPY column list) is derived from `TransitionRecord`; these
tests fail when the record, `core/tables.py` and the migrated database disagree.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import orjson
import psycopg
from sqlalchemy.dialects import postgresql

from core.codecs import pack, pack_digests, packed_uuid
from core.record import TRANSITION_COLUMNS, TransitionRecord, copy_row
from core.tables import Transition

# Postgres's name for each COPY type, as information_schema.columns.udt_name spells it.
UDT = {"bytea[]": "_bytea"}


def sample(**fields: Any) -> TransitionRecord:
    values: dict[str, Any] = {
        "id": "8a6e0804-2bd0-4672-b79d-d97027f70706",
        "episode_id": "e1",
        "request_id": "5a0f3b7e-3b1c-4e5e-9b1a-0c2d3e4f5a6b",
        "choice_index": 1,
        "task_id": "t1",
        "agent_name": "writer",
        "requested_at": 1_795_000_000.25,
        "route": "chat",
        "status": "ok",
        "http_status": 200,
        "model_requested": "policy",
        "model_used": "policy-v3",
        "policy_version": 3,
        "messages": [{"role": "user", "content": "2+3?"}],
        "params": {"model": "policy", "temperature": 1.0},
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [7, 8],
        "logprobs": [-0.5, -0.25],
        "text": "5",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
        "finish_reason": "stop",
        "error": None,
        "latency_ms": 12.5,
        "prompt_tokens": 3,
        "completion_tokens": 2,
    }
    return TransitionRecord(**(values | fields))


def test_every_record_column_is_a_transition_column_of_the_same_type() -> None:
    table = Transition.__table__.columns
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    for name, pg_type in TRANSITION_COLUMNS:
        assert name in table, f"the record writes {name!r}, which core/tables.py lacks"
        declared = table[name].type.compile(dialect=dialect).lower()
        expected = {"int2": "smallint", "int4": "integer", "float8": "double precision"}
        expected |= {"timestamptz": "timestamp with time zone", "bytea[]": "bytea[]"}
        assert declared == expected.get(pg_type, pg_type), (name, declared, pg_type)


def test_the_migrated_table_takes_every_record_and_needs_nothing_else(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        columns = {
            name: (udt, nullable == "YES" or default is not None)
            for name, udt, nullable, default in conn.execute(
                "SELECT column_name, udt_name, is_nullable, column_default "
                "FROM information_schema.columns WHERE table_name = 'transition'"
            )
        }
    record = dict(TRANSITION_COLUMNS)
    for name, pg_type in record.items():
        assert name in columns, f"the record writes {name!r}, which the migrations lack"
        assert columns[name][0] == UDT.get(pg_type, pg_type), (name, columns[name][0], pg_type)
    required = {name for name, (_, optional) in columns.items() if not optional}
    assert required <= set(record), f"COPY would leave NOT NULL {required - set(record)} empty"


def test_copy_row_puts_each_field_in_its_column() -> None:
    r = sample()
    digests, prompt_ids = pack_digests([b"\x01" * 16]), pack(r.prompt_token_ids, "i")
    row = dict(
        zip(
            [name for name, _ in TRANSITION_COLUMNS],
            copy_row(r, digests, None, prompt_ids),
            strict=True,
        )
    )
    assert row["id"] == packed_uuid(r.id) and row["request_id"] == packed_uuid(r.request_id)
    assert row["requested_at"] == datetime.fromtimestamp(r.requested_at, UTC)
    assert row["message_digests"] == digests and row["prompt_token_ids"] == prompt_ids
    assert row["prompt_blocks"] is None
    assert row["completion_token_ids"] == pack([7, 8], "i")
    assert row["logprobs"] == pack([-0.5, -0.25], "f")
    encoded = {"id", "request_id", "requested_at", "message_digests", "prompt_token_ids"}
    encoded |= {"prompt_blocks"}
    encoded |= {"completion_token_ids", "logprobs"}
    for f in dataclasses.fields(TransitionRecord):
        column = f.metadata["column"] or f.name
        if column not in encoded:
            assert row[column] == getattr(r, f.name), column


def test_a_record_survives_the_journal() -> None:
    r = sample()
    assert TransitionRecord.from_json(orjson.loads(orjson.dumps(r))) == r


def test_a_journal_line_from_another_version_still_replays() -> None:
    """Written before the record was typed (a failed call: no token ids), plus a key some later
    version might add: the missing fields take their defaults, the unknown one is dropped."""
    line = (
        b'{"id":"8a6e0804-2bd0-4672-b79d-d97027f70706","episode_id":"e1",'
        b'"request_id":"5a0f3b7e-3b1c-4e5e-9b1a-0c2d3e4f5a6b","choice_index":0,"task_id":null,'
        b'"agent_name":null,"requested_at":1795000000.0,"route":"chat","status":"failed",'
        b'"http_status":502,"model_requested":"policy","model_used":"demo","policy_version":0,'
        b'"messages":[{"role":"user","content":"hi"}],"params":{"model":"policy"},'
        b'"latency_ms":1.0,"error":{"error":{"message":"unreachable"}},"added_later":1}'
    )
    r = TransitionRecord.from_json(orjson.loads(line))
    assert r.status == "failed" and r.error == {"error": {"message": "unreachable"}}
    assert r.prompt_token_ids is None and r.text is None and r.tool_calls is None
