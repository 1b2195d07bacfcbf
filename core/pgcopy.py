"""Binary COPY into a table, skipping rows that are there already.

COPY is one round trip for the whole batch (an executemany runs one INSERT per row), and binary
COPY sends packed bytes as they are (text COPY escapes every bytea byte). COPY cannot skip
duplicates, so it goes straight into the table under a savepoint; only when that meets a row
already there (a journal replay, a message another writer stored) do the rows go through a
per-connection temporary table and INSERT ... ON CONFLICT DO NOTHING.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import psycopg
from psycopg.abc import Buffer
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types.json import set_json_dumps
from sqlalchemy.ext.asyncio import AsyncSession

from core.codecs import BYTEA_ARRAY_OID, UUID_OID, PackedDigests, PackedUuid

set_json_dumps(orjson.dumps)  # jsonb values in COPY rows: orjson's JSON, as everywhere here

# (column name, Postgres type) in row order
Columns = Sequence[tuple[str, str]]


async def copy_insert(
    session: AsyncSession,
    table: str,
    columns: Columns,
    rows: Sequence[Sequence[Any]],
    *,
    on_conflict: str = "DO NOTHING",
) -> None:
    """COPY `rows` into `table` within the session's transaction (the caller commits); rows
    there already get `ON CONFLICT {on_conflict}`."""
    names = ", ".join(f'"{name}"' for name, _ in columns)
    types = [pg_type for _, pg_type in columns]
    connection = await session.connection()
    raw = (await connection.get_raw_connection()).driver_connection
    assert raw is not None, "the session's connection is closed"
    async with raw.cursor() as cursor:
        cursor.adapters.register_dumper(PackedDigests, PackedDigestsDumper)
        cursor.adapters.register_dumper(PackedUuid, PackedUuidDumper)
        await cursor.execute("SAVEPOINT copy_insert")
        try:
            await _copy(cursor, table, names, types, rows)
        except psycopg.errors.UniqueViolation:
            await cursor.execute("ROLLBACK TO SAVEPOINT copy_insert")
        else:
            await cursor.execute("RELEASE SAVEPOINT copy_insert")
            return
        await cursor.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {table}_in (LIKE {table} INCLUDING DEFAULTS) "
            "ON COMMIT DELETE ROWS"
        )
        await _copy(cursor, f"{table}_in", names, types, rows)
        await cursor.execute(
            f"INSERT INTO {table} ({names}) SELECT {names} FROM {table}_in "
            f"ON CONFLICT {on_conflict}"
        )


async def _copy(
    cursor: psycopg.AsyncCursor[Any],
    table: str,
    names: str,
    types: list[str],
    rows: Sequence[Sequence[Any]],
) -> None:
    async with cursor.copy(f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(types)
        for row in rows:
            await copy.write_row(row)


# COPY picks a column's dumper by the type given to set_types(); registering these (per COPY
# cursor) makes them the dumpers for `bytea[]` and `uuid`, in place of psycopg's per-element and
# per-object Python ones: the values arrive packed (core/codecs.py).


class _AsIs(Dumper):
    format = Format.BINARY

    def dump(self, obj: Any) -> Buffer:
        return obj  # type: ignore[no-any-return]


class PackedDigestsDumper(_AsIs):
    oid = BYTEA_ARRAY_OID


class PackedUuidDumper(_AsIs):
    oid = UUID_OID
