"""The schema at start-up: migrate it, or, if Postgres does not answer, start anyway.

A proxy that cannot reach Postgres when it starts (a restart or a reschedule during an outage)
still serves: its sessions stay closed (`GatedSessions.migrated` is False, so every reader and
writer sees `NotMigrated`, an outage), transitions go to the journal as in any outage, rewards and
reads answer as they do then, and this retries the migration every `retry_s`. Once it succeeds the
sessions open and the writer replays the journal into the migrated schema.

A migration that fails for another reason (a broken migration, a missing privilege) stops the
start-up, as before: that is not an outage, and serving on a schema the code does not match
would record into the wrong tables. If the same happens on a later try, it is logged and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from core import database
from core.database import OUTAGE_ERRORS, GatedSessions

log = logging.getLogger(__name__)


class Migrator:
    def __init__(self, url: str, *sessions: GatedSessions, retry_s: float) -> None:
        self._url = url
        self._gates = sessions  # the readers' and the writer's pools: opened together
        self._retry_s = retry_s
        self._task: asyncio.Task[None] | None = None
        self._done = asyncio.Event()

    @property
    def migrated(self) -> bool:
        return all(gate.migrated for gate in self._gates)

    def _open(self, migrated: bool) -> None:
        for gate in self._gates:
            gate.migrated = migrated

    async def wait(self) -> None:
        """Returns once the schema is migrated (at once if it was at start-up)."""
        await self._done.wait()

    async def start(self) -> None:
        try:
            await asyncio.to_thread(database.migrate, self._url)
        except OUTAGE_ERRORS as e:
            log.warning(
                "Postgres unreachable at start-up (%s): serving, recording to the journal, "
                "and migrating once it answers (every %g s)",
                e,
                self._retry_s,
            )
            self._open(False)
            self._task = asyncio.create_task(self._retry(), name="flywheel-migrate")
            return
        self._done.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _retry(self) -> None:
        while not self.migrated:
            await asyncio.sleep(self._retry_s)
            try:
                await asyncio.to_thread(database.migrate, self._url)
            except OUTAGE_ERRORS as e:
                log.debug("still no Postgres to migrate: %s", e)
                continue
            except Exception:
                log.exception("migration failed; next try in %g s", self._retry_s)
                continue
            self._open(True)
            self._done.set()
            log.info("Postgres answers: schema migrated, the journal replays now")
