"""`transition`'s daily partitions (migration 0011): what there is, and making the days ahead.

One partition per UTC day, `transition_pYYYYMMDD`, covering [that day, the next). Rows that no
daily partition covers go to `transition_default`, so recording never fails for want of a
partition; `ensure` makes the coming days' partitions, and the day of any row the default
partition holds, moving those rows into it (a partition cannot be made over rows the default
partition holds for its range). `transition_legacy`, the table as it was before 0011, covers
everything up to the day after that migration ran.

Each change is one short transaction that gives up after `lock_timeout_s` rather than queue
the writer behind a long reader (making or dropping a partition locks the parent table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import Connection, Engine

PARENT = "transition"
DEFAULT = "transition_default"
LEGACY = "transition_legacy"
DAY = timedelta(days=1)
AHEAD_DAYS = 7  # days made ahead of today
LOCK_TIMEOUT_S = 2.0

_BOUND = re.compile(r"FROM \((.+?)\) TO \((.+?)\)")


@dataclass(frozen=True)
class Partition:
    name: str
    lo: datetime | None  # None: from the beginning of time (the legacy partition)
    hi: datetime


def is_partition(table: str) -> bool:
    """For Alembic's autogenerate: partitions are made at run time, not by migrations."""
    return table in (DEFAULT, LEGACY) or re.fullmatch(rf"{PARENT}_p\d{{8}}", table) is not None


def name_of(day: date) -> str:
    return f"{PARENT}_p{day:%Y%m%d}"


def start_of(day: date) -> datetime:
    return datetime.combine(day, time(), UTC)


def literal(at: datetime) -> str:
    """A bound as SQL (DDL takes no parameters; the value is ours, never a caller's)."""
    return f"'{at.astimezone(UTC).isoformat()}'"


def partitions(conn: Connection) -> list[Partition]:
    """Every range partition, oldest first (the default partition is not one)."""
    conn.exec_driver_sql("SET LOCAL TimeZone = 'UTC'")  # bounds printed in UTC
    rows = conn.exec_driver_sql(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %(parent)s::regclass",
        {"parent": PARENT},
    ).all()
    found = []
    for name, bound in rows:
        if (m := _BOUND.search(bound)) is None:
            continue  # DEFAULT
        lo, hi = (
            None if v == "MINVALUE" else datetime.fromisoformat(v.strip("'")) for v in m.groups()
        )
        assert hi is not None, f"{name}: no upper bound"
        found.append(Partition(name, lo, hi))
    return sorted(found, key=lambda p: p.hi)


def ensure(
    engine: Engine, *, today: date, ahead: int = AHEAD_DAYS, lock_timeout_s: float = LOCK_TIMEOUT_S
) -> list[str]:
    """Make the partitions of `today` .. `today + ahead` and of every day the default partition
    holds rows for (moving them in); returns the names made. A day a partition covers already
    (the legacy one's, say) is left alone."""
    with engine.begin() as conn:
        have = partitions(conn)
        waiting = conn.exec_driver_sql(
            f"SELECT DISTINCT (requested_at AT TIME ZONE 'UTC')::date FROM {DEFAULT}"
        ).scalars()
        days = {today + i * DAY for i in range(ahead + 1)} | set(waiting)
    made = []
    for day in sorted(days):
        if not any(_covers(p, start_of(day)) for p in have):
            _make(engine, day, lock_timeout_s)
            made.append(name_of(day))
    return made


def _covers(p: Partition, at: datetime) -> bool:
    return (p.lo is None or p.lo <= at) and at < p.hi


def _make(engine: Engine, day: date, lock_timeout_s: float) -> None:
    lo, hi = literal(start_of(day)), literal(start_of(day + DAY))
    in_range = f"requested_at >= {lo} AND requested_at < {hi}"
    with engine.begin() as conn:
        lock_for_ddl(conn, lock_timeout_s)  # from here no row can reach the default partition
        conn.exec_driver_sql(
            "CREATE TEMP TABLE moving ON COMMIT DROP AS "
            f"WITH d AS (DELETE FROM {DEFAULT} WHERE {in_range} RETURNING *) SELECT * FROM d"
        )
        conn.exec_driver_sql(
            f"CREATE TABLE IF NOT EXISTS {name_of(day)} PARTITION OF {PARENT} "
            f"FOR VALUES FROM ({lo}) TO ({hi})"
        )
        conn.exec_driver_sql(f"INSERT INTO {PARENT} SELECT * FROM moving")


def lock_for_ddl(conn: Connection, lock_timeout_s: float) -> None:
    """The lock that making or dropping a partition takes on the parent, taken first (a writer
    takes the parent before a partition too), giving up after `lock_timeout_s`
    (LockNotAvailable) rather than queue every writer behind a long reader."""
    conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(lock_timeout_s * 1000)}ms'")
    conn.exec_driver_sql(f"LOCK TABLE ONLY {PARENT} IN ACCESS EXCLUSIVE MODE")
