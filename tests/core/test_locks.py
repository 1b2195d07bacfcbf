"""Advisory locks (core/locks.py, issue 31): one key per purpose, every user takes its key from
the registry, and a maintenance round in progress never holds up a publish, a rollback, a pin or
a canary decision (it did: both used one key)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from core import canary, partitions, pins, policy, retirement
from core.database import Sessions
from core.locks import Lock
from proxy.config import ProxySettings
from proxy.record.maintenance import Maintenance

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["core", "proxy", "trainer", "judge", "migrations", "flywheel", "bench", "fakes", "demo"]
ADVISORY_CALL = re.compile(r"pg_\w*advisory\w*\(|locks\.hold\(")  # hold: a transaction lock
LITERAL_KEY = re.compile(r"pg_\w*advisory\w*\(\s*\d")
# A statement that waits longer than this for a lock fails (LockNotAvailable): nothing here
# should wait for a lock at all, so a failure means a wait, however fast the machine.
LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s'"


def test_every_purpose_has_a_key_of_its_own() -> None:
    keys = [lock.value for lock in Lock]
    assert len(set(keys)) == len(keys) == len(Lock.__members__)  # no aliases either
    assert {lock.name for lock in Lock} >= {"MIGRATE", "PUBLISH", "MAINTENANCE"}


def test_every_advisory_lock_takes_its_key_from_the_registry() -> None:
    """No key spelled as a number anywhere else: a module that takes an advisory lock imports
    core.locks, so two purposes can only share a key by sharing a name."""
    users = []
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            if not ADVISORY_CALL.search(source) or path == ROOT / "core" / "locks.py":
                continue
            where = path.relative_to(ROOT)
            users.append(str(where))
            assert not LITERAL_KEY.search(source), f"{where}: an advisory lock key as a literal"
            assert "from core.locks import Lock" in source, f"{where}: key not from core.locks"
    assert {
        "core/policy.py",
        "core/pins.py",
        "proxy/record/maintenance.py",
        "migrations/env.py",
    } <= set(users)


@pytest.fixture
def round_in_progress(database_url: str, tmp_path: Path) -> Iterator[None]:
    """A real maintenance round, held mid-way under its advisory lock: another connection holds
    the default partition, which the round reads before making partitions (as a long retention
    holds it, minutes with archiving)."""
    maintenance = Maintenance(
        ProxySettings(database_url=database_url, home=tmp_path / "home"), database_url
    )
    blocker = psycopg.connect(database_url)
    blocker.execute(f"LOCK TABLE {partitions.DEFAULT} IN ACCESS EXCLUSIVE MODE")
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(maintenance.once()))
    thread.start()
    try:
        _wait_for_round_to_block(database_url)
        yield
    finally:
        blocker.rollback()
        blocker.close()
        thread.join(60)
        asyncio.run(maintenance.stop())
    assert not thread.is_alive() and done == [None]  # the round went on and finished


def _wait_for_round_to_block(database_url: str) -> None:
    """Until the round holds an advisory lock (on a connection of its own) and its work waits
    for the default partition."""
    mine = "database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    sql = f"""
        SELECT 1 WHERE EXISTS (SELECT FROM pg_locks WHERE {mine} AND locktype = 'advisory'
                                                     AND granted)
        AND EXISTS (SELECT FROM pg_locks WHERE {mine} AND NOT granted
                                           AND relation = '{partitions.DEFAULT}'::regclass)"""
    deadline = time.monotonic() + 30
    with psycopg.connect(database_url, autocommit=True) as conn:
        while not conn.execute(sql).fetchall():
            assert time.monotonic() < deadline, "the maintenance round never got under way"
            time.sleep(0.02)


def publish(sessions: Sessions, version: int, **fields: Any) -> None:
    with sessions.begin() as session:
        session.execute(text(LOCK_TIMEOUT))
        parent = policy.current(session=session)
        policy.publish(
            session=session,
            lineage="policy",
            parent=parent.version if parent else None,
            version=version,
            path=f"/adapters/{version}",
            base_model="demo",
            stats={},
            trained_transitions=1,
            **fields,
        )


def current(sessions: Sessions) -> int | None:
    with sessions() as session:
        adapter = policy.current(session=session)
    return adapter.version if adapter else None


@pytest.mark.usefixtures("round_in_progress")
def test_a_maintenance_round_never_holds_up_the_policys_moves(sessions: Sessions) -> None:
    """Publish, rollback, pin, unpin, a canary's decision and retirement each complete while a
    round is in progress, none waiting on a lock (lock_timeout would raise LockNotAvailable)."""
    publish(sessions, 1)
    publish(sessions, 2)
    assert current(sessions) == 2
    with sessions.begin() as session:  # a rollback (what rollout.activate commits), pinned
        session.execute(text(LOCK_TIMEOUT))
        policy.make_current(1, session=session, pin=True, note="incident")
    with sessions.begin() as session:
        session.execute(text(LOCK_TIMEOUT))
        assert pins.unpin("policy", session=session) is not None
    rule = canary.Rule(fraction=0.5)
    publish(sessions, 3, canary_rule=rule)  # a candidate beside v1
    with sessions.begin() as session:
        session.execute(text(LOCK_TIMEOUT))
        [opened] = canary.opened(session=session).values()
        decision = canary.Decision("promote", "not_worse", canary.Evidence(30, 30, 1.0, 0.5))
        assert policy.decide_canary(opened, decision, session=session)
    with sessions.begin() as session:
        session.execute(text(LOCK_TIMEOUT))
        retirement.mark_retired(session=session, lineage="policy", keep=1)
    assert current(sessions) == 3
