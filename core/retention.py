"""`flywheel retain` and the proxy's FLYWHEEL_RETENTION_DAYS: drop (or archive, then drop) the
daily partitions of `transition` older than N days, and what only they used.

- A partition that still holds untrained transitions a trainer would use (credited, trainable,
  served by a lineage) is kept unless `include_untrained`: the trainer has not had them yet.
- With `archive`, a partition is first exported (core/export.py, with token ids) to
  `<archive>/<partition>.parquet`, and dropped only if it still holds exactly those rows.
- With a partition go its transitions' step rewards (no foreign key can reach a partitioned
  table), then every episode older than the cutoff that has no transition left (with its
  rewards), then every message and token id block last used before the oldest day still kept,
  less one day for clocks that disagree. The writer keeps their `last_used` at or after the day
  of every transition naming them and trusts its cache of stored ones for one day only
  (proxy/record/recorder.py), so none that a transition still names, or a writer is about to
  name, is deleted.

Each step is its own short transaction; the lock on `transition` is taken with a timeout, so a
long reader (an export) makes retention give up and try on the next run instead of stalling the
writer behind it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from core import export, partitions
from core.partitions import DAY, PARENT, Partition
from core.tables import TRAINABLE

log = logging.getLogger("flywheel.retention")

BATCH = 10_000  # episodes or messages deleted per transaction
# Untrained rows that a trainer would claim (trainer/data/store.py `_QUEUED`, less its filters).
_UNTRAINED = f"{TRAINABLE} AND lineage IS NOT NULL"
TABLES = ("transition", "message", "token_block", "episode", "reward", "judgement")
CONTENT = ("message", "token_block")  # stored once by digest, pruned by `last_used`


@dataclass(frozen=True)
class Decision:
    partition: Partition
    rows: int
    bytes: int
    untrained: int
    action: str  # "drop" | "keep" | "failed"
    reason: str = ""
    archive: Path | None = None
    rewards: int = 0  # its transitions' step rewards, deleted with it


@dataclass
class Retained:
    cutoff: datetime
    decisions: list[Decision] = field(default_factory=list)
    episodes: int = 0  # deleted
    rewards: int = 0  # deleted: step rewards of dropped transitions, rewards of deleted episodes
    messages: int = 0
    blocks: int = 0  # of prompts' token ids
    bytes_before: dict[str, int] = field(default_factory=dict)
    bytes_after: dict[str, int] = field(default_factory=dict)
    # by step: days, episodes, messages (and token blocks)
    seconds: dict[str, float] = field(default_factory=dict)


def sizes(engine: Engine) -> dict[str, int]:
    """Bytes on disk of each table, indexes and TOAST included (`transition`: all partitions).
    One relation a statement, in autocommit: holding one partition's lock while waiting for
    another's would deadlock with DDL that takes them the other way round."""
    out = {}
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in TABLES:
            relations = conn.exec_driver_sql(  # (none when it is not partitioned)
                "SELECT relid::text FROM pg_partition_tree(%(t)s::regclass)", {"t": table}
            ).scalars()
            out[table] = sum(
                conn.exec_driver_sql(  # (one dropped meanwhile is NULL: 0)
                    "SELECT coalesce(pg_total_relation_size(to_regclass(%(r)s)), 0)", {"r": r}
                ).scalar_one()
                for r in list(relations) or [table]
            )
    return out


def retain(
    engine: Engine,
    database_url: str,
    *,
    days: int,
    now: datetime | None = None,
    archive: Path | None = None,
    include_untrained: bool = False,
    dry_run: bool = False,
    lock_timeout_s: float = partitions.LOCK_TIMEOUT_S,
    on_decision: Callable[[Decision], None] = lambda d: None,
    stop: threading.Event | None = None,
) -> Retained:
    """Keep the last `days` whole UTC days (and today); see the module's doc for what goes.
    `stop`: once set, return after the step in progress (what is done so far)."""
    stop = stop or threading.Event()
    if days < 1:
        raise ValueError("days must be at least 1")
    today = (now or datetime.now(UTC)).astimezone(UTC).date()
    cutoff = partitions.start_of(today - days * DAY)
    result = Retained(cutoff, bytes_before=sizes(engine))
    if not dry_run:  # the default partition's rows into their days' partitions first
        partitions.ensure(engine, today=today, ahead=0, lock_timeout_s=lock_timeout_s)
    with engine.begin() as conn:
        old = [p for p in partitions.partitions(conn) if p.hi <= cutoff]
    started = time.perf_counter()
    for p in old:
        if stop.is_set():
            return result
        decision = _decide(engine, p, include_untrained)
        if decision.action == "drop" and not dry_run:
            decision = _drop(engine, database_url, decision, archive, lock_timeout_s)
        result.decisions.append(decision)
        on_decision(decision)
    result.seconds["days"] = time.perf_counter() - started
    if stop.is_set():
        return result
    if not dry_run:
        started = time.perf_counter()
        result.episodes, rewards = _prune_episodes(engine, cutoff, stop)
        result.rewards = rewards + sum(d.rewards for d in result.decisions)
        result.seconds["episodes"] = time.perf_counter() - started
        started = time.perf_counter()
        keep_from = _content_kept_from(engine, today)
        result.messages, result.blocks = (
            _prune_content(engine, t, keep_from, stop) for t in CONTENT
        )
        result.seconds["messages"] = time.perf_counter() - started
    result.bytes_after = sizes(engine)
    return result


def _decide(engine: Engine, p: Partition, include_untrained: bool) -> Decision:
    with engine.begin() as conn:
        rows, size, untrained = conn.exec_driver_sql(
            f"SELECT (SELECT count(*) FROM {p.name}), pg_total_relation_size('{p.name}'), "
            f"(SELECT count(*) FROM {p.name} WHERE {_UNTRAINED})"
        ).one()
    if untrained and not include_untrained:
        reason = f"{untrained} untrained transitions (--include-untrained drops them)"
        return Decision(p, rows, size, untrained, "keep", reason)
    return Decision(p, rows, size, untrained, "drop")


def _drop(
    engine: Engine, database_url: str, d: Decision, archive: Path | None, lock_timeout_s: float
) -> Decision:
    p = d.partition
    path = None
    if archive is not None:
        archive.mkdir(parents=True, exist_ok=True)
        path = archive / f"{p.name}.parquet"
        where = export.ExportFilter(since=p.lo, until=p.hi)
        written = export.export(database_url, path, where=where, tokens=True).rows
    try:
        with engine.begin() as conn:
            partitions.lock_for_ddl(conn, lock_timeout_s)  # from here nothing enters it
            conn.exec_driver_sql(f"LOCK TABLE {p.name} IN ACCESS EXCLUSIVE MODE")
            rows, untrained = conn.exec_driver_sql(
                f"SELECT count(*), count(*) FILTER (WHERE {_UNTRAINED}) FROM {p.name}"
            ).one()
            if untrained > d.untrained or (path is not None and rows != written):
                conn.rollback()
                return _failed(d, "it changed while being decided on or archived; next run")
            rewards = conn.exec_driver_sql(  # (by the index: a join would read all rewards)
                f"DELETE FROM reward WHERE transition_id = ANY(ARRAY(SELECT id FROM {p.name}))"
            ).rowcount
            conn.exec_driver_sql(f"DROP TABLE {p.name}")
    except OperationalError as e:  # the lock timeout, mostly
        return _failed(d, f"{type(e.orig).__name__}: {str(e.orig).strip()}; next run")
    return Decision(p, rows, d.bytes, untrained, "drop", archive=path, rewards=rewards)


def _failed(d: Decision, reason: str) -> Decision:
    log.warning("retention kept %s: %s", d.partition.name, reason)
    return Decision(d.partition, d.rows, d.bytes, d.untrained, "failed", reason)


# Episodes retention may delete: begun before the cutoff, and with no call left. Those whose
# newest call is older than the cutoff need looking only in the old days (a partition bound:
# the days kept for their untrained rows, usually none); those without `last_call_at` (none
# recorded since migration 0011, or rewards only) in every day. Both conditions are re-checked
# on the row under its lock (a writer recording a call moves `last_call_at` under that lock).
_DOOMED = """
SELECT id FROM episode e
WHERE created_at < %(cutoff)s AND {last_call}
  AND NOT EXISTS (SELECT 1 FROM transition t WHERE t.episode_id = e.id {bound})
ORDER BY created_at LIMIT %(n)s FOR UPDATE OF e SKIP LOCKED"""
_DOOMED_QUERIES = (
    _DOOMED.format(last_call="last_call_at < %(cutoff)s", bound="AND t.requested_at < %(cutoff)s"),
    _DOOMED.format(last_call="last_call_at IS NULL", bound=""),
)


def _prune_episodes(engine: Engine, cutoff: datetime, stop: threading.Event) -> tuple[int, int]:
    """Episodes begun before the cutoff with no call left, their rewards and judgements."""
    episodes = rewards = 0
    for doomed in _DOOMED_QUERIES:
        while not stop.is_set():
            with engine.begin() as conn:
                ids = list(conn.exec_driver_sql(doomed, {"cutoff": cutoff, "n": BATCH}).scalars())
                rewards += conn.exec_driver_sql(
                    "DELETE FROM reward WHERE episode_id = ANY(%(ids)s)", {"ids": ids}
                ).rowcount
                conn.exec_driver_sql(
                    "DELETE FROM judgement WHERE episode_id = ANY(%(ids)s)", {"ids": ids}
                )
                episodes += conn.exec_driver_sql(
                    "DELETE FROM episode WHERE id = ANY(%(ids)s)", {"ids": ids}
                ).rowcount
            if len(ids) < BATCH:
                break
    return episodes, rewards


def _content_kept_from(engine: Engine, today: date) -> date:
    """Messages and blocks last used before this day go: a day before the oldest transition
    kept (clocks that disagree), or before today."""
    with engine.begin() as conn:
        oldest = conn.exec_driver_sql(f"SELECT min(requested_at) FROM {PARENT}").scalar()
    return min(today, oldest.astimezone(UTC).date() if oldest else today) - DAY


def _prune_content(engine: Engine, table: str, keep_from: date, stop: threading.Event) -> int:
    deleted = 0
    while not stop.is_set():
        with engine.begin() as conn:
            n = conn.exec_driver_sql(
                f"DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {table} "
                "WHERE last_used < %(day)s LIMIT %(n)s))",
                {"day": keep_from, "n": BATCH},
            ).rowcount
        deleted += n
        if n < BATCH:
            break
    return deleted
