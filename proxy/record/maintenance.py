"""The proxy's housekeeping: at start-up and every FLYWHEEL_MAINTENANCE_S, the coming days'
partitions of `transition` (core/partitions.py) and, with FLYWHEEL_RETENTION_DAYS, retention
(core/retention.py).

One replica at a time does it (a session advisory lock, Lock.MAINTENANCE: its own key, so a
round never holds up a publish or a rollback; the others skip that round). The work
is sync SQL and DDL on a small engine of its own, run in a thread: nothing here waits on the
event loop that serves calls, and nothing there waits on it (recording goes to the default
partition when a day's partition is missing).

Shutdown does not wait for a round (retention can take minutes): the round is told to stop after
the step it is in (each step is its own transaction), and its thread is a daemon, so it never
keeps a stopped proxy's process alive (asyncio.to_thread's pool is joined at exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar, cast

from sqlalchemy import create_engine, pool

from core import database, partitions, retention
from core.locks import Lock
from proxy.config import ProxySettings

log = logging.getLogger("flywheel.maintenance")

T = TypeVar("T")


class Maintenance:
    def __init__(self, settings: ProxySettings, database_url: str) -> None:
        self._settings = settings
        self._url = database_url
        self._engine = create_engine(database.sqlalchemy_url(database_url), poolclass=pool.NullPool)
        self._task: asyncio.Task[None] | None = None
        self._stopping = threading.Event()  # a round in progress stops after its current step

    async def start(self, *, after: Awaitable[None] | None = None) -> None:
        """Rounds begin once `after` is done (the schema migrated: proxy/record/migrator.py)."""
        self._task = asyncio.create_task(self._run(after), name="flywheel-maintenance")

    async def stop(self) -> None:
        """At once, even in the middle of a round (which is left to stop on its own)."""
        self._stopping.set()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._engine.dispose()

    async def _run(self, after: Awaitable[None] | None) -> None:
        if after is not None:
            await after
        while True:
            try:
                await in_daemon_thread(self.once)
            except Exception:  # Postgres down, a lock timeout: the next round tries again
                log.exception(
                    "maintenance failed; next try in %.0f s", self._settings.maintenance_s
                )
            await asyncio.sleep(self._settings.maintenance_s)

    def once(self) -> retention.Retained | None:
        """One round, if no other replica is at it; returns what retention did (None: none)."""
        key = int(Lock.MAINTENANCE)
        with self._engine.connect().execution_options(isolation_level="AUTOCOMMIT") as lock:
            if not lock.exec_driver_sql(f"SELECT pg_try_advisory_lock({key})").scalar():
                return None
            try:
                made = partitions.ensure(self._engine, today=datetime.now(UTC).date())
                if made:
                    log.info("made partitions %s", ", ".join(made))
                days = self._settings.retention_days
                if days is None or self._stopping.is_set():
                    return None
                done = retention.retain(
                    self._engine,
                    self._url,
                    days=days,
                    archive=self._settings.retention_archive_dir,
                    stop=self._stopping,
                )
                for d in done.decisions:
                    log.info(
                        "retention: %s, %d rows: %s %s",
                        d.partition.name,
                        d.rows,
                        d.action,
                        d.reason,
                    )
                return done
            finally:
                lock.exec_driver_sql(f"SELECT pg_advisory_unlock({key})")


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a thread of its own that does not keep the process alive; cancelling the
    awaiting task leaves it running to its end."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: Exception | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(cast(T, result))

    def work() -> None:
        result, error = None, None
        try:
            result = fn()
        except Exception as e:
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="flywheel-maintenance", daemon=True).start()
    return await done
