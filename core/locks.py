"""Every Postgres advisory lock Flywheel takes, one key per purpose, all in one place.

Advisory locks are one namespace per database: two purposes that share a key wait for each other
for no reason. They did (issue 31): retention ran under the publish key, so every publish,
rollback, pin and canary decision waited out a maintenance round, the trainer holding its batch's
row locks meanwhile. So every `pg_*advisory*` call takes its key from here (tests/core/test_locks.py
keeps it so), and a new purpose gets a new key.

    MIGRATE      session lock, migrations/env.py: one migrator at a time (several proxies may
                 start together against one database)
    PUBLISH      transaction lock, core/policy.py: whoever moves a lineage's `is_current`, pins,
                 decides a canary or retires a version (publish, activate, pin, unpin, retire)
    MAINTENANCE  session lock, try-only, proxy/record/maintenance.py: one replica at a time makes
                 partitions and runs retention; the others skip the round

The values are stable (other processes of another release may hold them during a rolling
upgrade): never renumber one, add a new one. MAINTENANCE was 7239012 (PUBLISH's) before issue 31.
"""

from __future__ import annotations

from enum import IntEnum, unique

from sqlalchemy import text
from sqlalchemy.orm import Session


@unique  # two purposes with one key would wait for each other: refused at import
class Lock(IntEnum):
    MIGRATE = 7239011
    PUBLISH = 7239012
    MAINTENANCE = 7239013


def hold(lock: Lock, *, session: Session) -> None:
    """Take `lock` for the rest of the session's transaction (released at commit or rollback)."""
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": int(lock)})
