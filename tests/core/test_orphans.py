"""A backend whose client vanished mid-transaction does not hold its locks for hours
(core/database.py SERVER_OPTIONS): Postgres probes a TCP client it has not heard from, and ends
a write transaction left idle. Without these, a proxy host gone mid-write (or a partition that
began while the proxy held the turn) left its backend "idle in transaction" for the kernel's
two hours, and every later write to the same episodes, the journal's replay of that very batch
among them, waited behind its row locks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from core import database
from demo.vllm_server import free_port
from fakes.pg import OwnPostgres
from tests.conftest import RunningProxy
from tests.core.test_pools import run_in_proxy

LOCK = 4242  # an advisory lock held by a transaction, as a row lock would be


async def show(sessions: database.AsyncSessions, name: str) -> str:
    async with sessions.begin() as session:
        return str((await session.execute(text(f"SHOW {name}"))).scalar())


def test_the_proxys_write_pools_end_a_transaction_left_idle(proxy: RunningProxy) -> None:
    services = proxy.services
    name = "idle_in_transaction_session_timeout"
    for sessions in (services.writer_sessions, services.reward_sessions):
        assert run_in_proxy(proxy, show(sessions, name)).result(30) == "1min"
    # Readers are not bounded by it: an export holds its transaction while its client reads.
    assert run_in_proxy(proxy, show(services.sessionmaker, name)).result(30) == "0"


async def test_a_transaction_left_idle_is_ended_and_its_locks_freed(database_url: str) -> None:
    engine, sessions = database.create_async_sessions(
        database_url, pool_size=1, idle_in_transaction_s=1
    )
    try:
        session = sessions()
        await session.begin()
        await session.execute(text(f"SELECT pg_advisory_xact_lock({LOCK})"))
        with psycopg.connect(database_url, autocommit=True) as other:
            taken = "SELECT pg_try_advisory_xact_lock(%s)"
            assert other.execute(taken, (LOCK,)).fetchone() == (False,)  # held
            await asyncio.sleep(2.5)  # the holder went quiet inside its transaction
            assert other.execute(taken, (LOCK,)).fetchone() == (True,)  # ended, lock freed
        with pytest.raises(Exception) as ended:
            await session.execute(text("SELECT 1"))  # the session learns it on its next word
        assert database.is_outage(ended.value)  # a write retries it (journaled meanwhile)
        await session.close()
    finally:
        await engine.dispose()


def test_postgres_probes_its_tcp_clients_unless_the_url_says_otherwise(tmp_path: Path) -> None:
    pg = OwnPostgres(tmp_path, tcp_port=free_port())  # (keepalives do not apply to a socket)
    try:
        with psycopg.connect(pg.url, **database.connect_args(pg.url)) as conn:
            for name, value in database.SERVER_OPTIONS.items():
                assert conn.execute(f"SHOW {name}").fetchone() == (str(value),), name
    finally:
        pg.close()
    own = "postgresql://u@h/db?options=-c%20search_path%3Dx&connect_timeout=2"
    assert {"options", "connect_timeout"}.isdisjoint(database.connect_args(own))
