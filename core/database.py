"""Where the database comes from (a configured URL, or an embedded PostgreSQL under
FLYWHEEL_HOME: core/embedded.py), how to connect to it (async for the proxy, sync for the
trainer) and the Alembic migrations (at start-up and for `flywheel migrate`).

SQL that both processes run (the adapter lifecycle, `core/policy.py`) is written once, for a sync
`Session`; the proxy runs it on its async session with `run_sync`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson
import psycopg
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, sessionmaker

from core import embedded

log = logging.getLogger(__name__)

T = TypeVar("T")
AsyncSessions = async_sessionmaker[AsyncSession]
Sessions = sessionmaker[Session]


def sqlalchemy_url(url: str) -> str:
    """`postgresql://...` as users write it -> the psycopg 3 dialect SQLAlchemy needs."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url.removeprefix(prefix)
    raise ValueError(f"database URL must start with postgresql://, got {url.split(':')[0]}://...")


def libpq_url(url: str) -> str:
    """The same URL as plain libpq takes it (for psycopg connections outside SQLAlchemy)."""
    return "postgresql://" + sqlalchemy_url(url).removeprefix("postgresql+psycopg://")


def with_database(url: str, name: str) -> str:
    """The same server's URL for database `name` (also `postgresql://u@/postgres?host=DIR`)."""
    base, _, query = url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")


def resolve_url(database_url: str | None, home: Path) -> str:
    return sqlalchemy_url(database_url or embedded.url(home))


# Alembic's scripts, found by path: `migrations` is a package beside `core` (in a checkout and in
# site-packages alike) that stands on core's tables, so core does not import it.
MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    """Alembic's configuration for the database at `url` (no alembic.ini: this is all of it)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["url"] = sqlalchemy_url(url)
    return config


def migrate(url: str) -> None:
    """Bring the schema to the newest migration (idempotent; safe with several starting proxies)."""
    command.upgrade(alembic_config(url), "head")


class PostgresRefused(Exception):
    """Postgres answered but refused for a reason of its own, not the row's: a read-only standby
    after a failover (SQLSTATE 25006), a missing privilege (42501), a table or column not
    migrated yet (42P01, 42703). Treated as an outage: the rows wait (journaled) and are tried
    again; they are not the rows' fault. Raised by `refusals_as_outage`."""


# Errors that mean "Postgres is not there right now", as opposed to "Postgres refused this row".
# psycopg's own: COPY runs on the driver's connection, unwrapped by SQLAlchemy. Its
# OperationalError includes a deadlock or a lock timeout: the batch is fine, only unlucky.
class NotMigrated(Exception):
    """The schema is not migrated yet: Postgres was unreachable when the proxy started, and it
    migrates as soon as Postgres answers (proxy/record/migrator.py). Until then it is an outage."""


OUTAGE_ERRORS = (
    NotMigrated,
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    psycopg.OperationalError,
    OSError,
    TimeoutError,
    sa_exc.TimeoutError,  # no pooled connection free within pool_timeout: Postgres lags
    PostgresRefused,
)


# SQLSTATE classes that are the row's fault: 22 (data exception: a value out of range, bad
# encoding), 23 (integrity constraint violation) and 54 (program limit exceeded: a value too
# large for an index row, an array too long). Retrying such a row never helps: it is set aside
# (the journal's rejected/), the rest of its batch stored. psycopg raises class 54 as an
# OperationalError, like a lost connection: the SQLSTATE decides, not the class.
ROW_FAULT_CLASSES = ("22", "23", "54")


def sqlstate(error: BaseException) -> str | None:
    """The SQLSTATE Postgres answered with (through SQLAlchemy's wrapper or psycopg's own)."""
    orig = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    return orig.sqlstate if isinstance(orig, psycopg.Error) else None


def is_outage(error: BaseException) -> bool:
    """Whether `error` means "not now" (retry later) rather than "not this row": an answer whose
    SQLSTATE is outside ROW_FAULT_CLASSES, or Postgres unreachable (OUTAGE_ERRORS, no SQLSTATE).
    An error without either (our own code refusing a value) is the row's."""
    state = sqlstate(error)
    if state is not None:
        return state[:2] not in ROW_FAULT_CLASSES
    return isinstance(error, OUTAGE_ERRORS)


class RowRefused(Exception):
    """Postgres refused the rows themselves with an error psycopg files under OperationalError
    (SQLSTATE class 54: a value too large for an index row). Not an outage: retrying never
    helps. Raised by `refusals_as_outage`."""


# After a write's deadline, how long its cleanup may talk to Postgres before the connection is
# dropped (see write_deadline).
CANCEL_GRACE_S = 1.0


@contextlib.asynccontextmanager
async def write_deadline(timeout_s: float, grace_s: float = CANCEL_GRACE_S) -> AsyncIterator[None]:
    """`asyncio.timeout` for a database write, which a hung Postgres cannot stretch. At the
    deadline the write is cancelled, and psycopg then asks the server to cancel the query (up to
    5 s) and waits for it to end (5 s more) before it closes the connection: a Postgres that
    hangs without closing (a paused container, a frozen VM: the kernel still answers TCP) answers
    neither, and the write ended 10 s late (docs/reliability.md). `grace_s` after the deadline a
    second cancel makes psycopg close the connection at once. TimeoutError either way."""
    task = asyncio.current_task()
    assert task is not None, "write_deadline runs in a task"
    loop = asyncio.get_running_loop()
    fired = False

    def again() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    second = loop.call_later(timeout_s + grace_s, again)
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except asyncio.CancelledError:
        if not fired:
            raise
        raise TimeoutError(f"a write past its {timeout_s:g} s deadline: dropped") from None
    finally:
        second.cancel()
        if fired:
            task.uncancel()  # ours: the caller's own cancellations still count


@contextlib.asynccontextmanager
async def refusals_as_outage() -> AsyncIterator[None]:
    """Around a write, the SQLSTATE decides (`is_outage`): a refusal that is not the rows' fault
    is raised as PostgresRefused, so that `except OUTAGE_ERRORS` waits and retries it; a refusal
    that is, whatever its exception class, as something `except OUTAGE_ERRORS` lets through."""
    try:
        yield
    except Exception as e:
        if is_outage(e):
            if isinstance(e, OUTAGE_ERRORS):
                raise
            raise PostgresRefused(f"{type(e).__name__} (SQLSTATE {sqlstate(e)}): {e}") from e
        if isinstance(e, OUTAGE_ERRORS):
            raise RowRefused(f"{type(e).__name__} (SQLSTATE {sqlstate(e)}): {e}") from e
        raise


# Both engines: pool_pre_ping, so that a Postgres restart does not leave dead connections that
# fail the next write; JSON by orjson both ways, as everywhere here (NaN becomes null, which jsonb
# accepts; what jsonb holds was parsed by orjson on the way in, so it parses back the same).


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


class GatedSessions(async_sessionmaker[AsyncSession]):
    """The proxy's sessions: while `migrated` is False, opening one raises NotMigrated (an outage
    to every caller), so nothing reads or writes a schema older than the code."""

    migrated = True

    def __call__(self, **local_kw: Any) -> AsyncSession:
        if not self.migrated:
            raise NotMigrated("the database schema is not migrated yet (Postgres unreachable)")
        return super().__call__(**local_kw)


# A Postgres that stops answering without closing the connection (a network partition, a host
# gone, a failover behind a dead address) must be an error within seconds, not a hang: without
# these, a connect waits for the kernel's SYN retries (~2 min), and a query on an open connection
# for its retransmissions (~15 min): the writer's 15 s write timeout covered only the writer, while
# a reward's transaction hung past every client's timeout (bench/chaos.py pg-partition).
# libpq's own options (https://www.postgresql.org/docs/current/libpq-connect.html), each only
# where the URL does not set it; on a Unix socket libpq ignores the TCP ones.
CONNECT_TIMEOUT_S = 5  # connecting (TCP, TLS, start-up): a live Postgres answers in milliseconds
TCP_USER_TIMEOUT_MS = 10_000  # data sent and not acknowledged: the peer is gone (< WRITE_TIMEOUT)
TCP_OPTIONS = {
    "connect_timeout": CONNECT_TIMEOUT_S,
    "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
    "keepalives": 1,  # an idle pooled connection to a vanished peer is found out, too
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


# The server's side of it: a backend whose client vanished mid-transaction (a partition that
# began while the client held the turn) waits for the client as long as the kernel lets it
# (~2 h), holding its row locks, and every later write to those rows (the journal's replay of the
# same batch) waits behind it. Postgres's own keepalives find a client that is gone once the
# network is back; a write transaction left idle longer than any of ours ever is, is ended.
# Session settings, sent as libpq's `options` (a URL that sets `options` keeps its own).
SERVER_OPTIONS = {
    "tcp_keepalives_idle": 10,
    "tcp_keepalives_interval": 5,
    "tcp_keepalives_count": 3,
}
WRITE_IDLE_IN_TRANSACTION_S = 60  # the recorder's and the posts' pools (proxy/services.py)


def connect_args(url: str, *, idle_in_transaction_s: float | None = None) -> dict[str, Any]:
    """TCP_OPTIONS and SERVER_OPTIONS less those the URL's query sets itself (a user's choice
    wins); `idle_in_transaction_s`: the server ends a transaction idle that long."""
    query = url.partition("?")[2]
    given = {part.split("=", 1)[0] for part in query.split("&") if part}
    server: dict[str, Any] = dict(SERVER_OPTIONS)
    if idle_in_transaction_s is not None:
        server["idle_in_transaction_session_timeout"] = max(1, round(idle_in_transaction_s * 1000))
    options = {"options": " ".join(f"-c {k}={v}" for k, v in server.items())}
    return {k: v for k, v in (TCP_OPTIONS | options).items() if k not in given}


def create_async_sessions(
    url: str,
    *,
    pool_size: int = 10,
    statement_timeout_s: float | None = None,
    idle_in_transaction_s: float | None = None,
) -> tuple[AsyncEngine, GatedSessions]:
    """The proxy's engine and sessions (dispose the engine at shutdown). With
    `statement_timeout_s`, every transaction begins with `SET LOCAL statement_timeout`: Postgres
    cancels a statement running longer (SQLSTATE 57014, `query_canceled`). With
    `idle_in_transaction_s`, Postgres ends a session idle that long inside a transaction."""
    engine = create_async_engine(
        sqlalchemy_url(url),
        connect_args=connect_args(url, idle_in_transaction_s=idle_in_transaction_s),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        json_serializer=_json,
        json_deserializer=orjson.loads,
    )
    if statement_timeout_s is not None:
        timeout_ms = max(1, round(statement_timeout_s * 1000))

        @event.listens_for(engine.sync_engine, "begin")
        def _bounded(conn: Connection) -> None:  # local to the transaction: pooled as it was
            conn.exec_driver_sql(f"SET LOCAL statement_timeout = {timeout_ms}")

    return engine, GatedSessions(engine, expire_on_commit=False)


QUERY_CANCELED = "57014"  # SQLSTATE of a statement cancelled (statement_timeout, or by hand)


def query_canceled(error: BaseException) -> bool:
    """Postgres cancelled the statement (a read past its statement_timeout)."""
    return getattr(getattr(error, "orig", error), "sqlstate", None) == QUERY_CANCELED


def create_sessions(url: str) -> tuple[Engine, Sessions]:
    """The trainer's (and the tools') engine and sessions: synchronous, like the trainer."""
    engine = create_engine(
        sqlalchemy_url(url),
        connect_args=connect_args(url),
        pool_pre_ping=True,
        json_serializer=_json,
        json_deserializer=orjson.loads,
    )
    return engine, sessionmaker(engine, expire_on_commit=False)


@contextlib.contextmanager
def migrated_session(database_url: str | None, home: Path) -> Iterator[Session]:
    """One transaction on the database a command names (the embedded one under `home` when
    unset), migrated first: what the CLI's short commands (`keys`, `eval`) run in."""
    url = resolve_url(database_url, home)
    migrate(url)
    engine, sessions = create_sessions(url)
    try:
        with sessions.begin() as session:
            yield session
    finally:
        engine.dispose()


async def run_sync(session: AsyncSession, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """Run a store function written for a sync session (`fn(*, session, ...)`) on this one."""
    return await session.run_sync(lambda sync_session: fn(session=sync_session, **kwargs))
