"""A Postgres behind a network partition (packets dropped, the connection never closed) is an
error within seconds, not a hang: the proxy's engine connects with a timeout and TCP timeouts
(core/database.py TCP_OPTIONS). Seen in bench/chaos.py pg-partition: rewards hung past every
client's timeout while their transaction waited on a dead connection."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import text

from core import database
from fakes import netfault

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("iptables"),
    reason="a partition drops packets with iptables (root)",
)
HANG_S = 40.0  # far past the options' 5-15 s; without them the query waits ~15 min


def over_tcp(url: str, port: int) -> str:
    """The test database's URL through the relay on 127.0.0.1:`port`."""
    parts = urlsplit(url)
    return f"postgresql://{parts.username}@127.0.0.1:{port}{parts.path}"


def socket_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parse_qs(parts.query)['host'][0]}/.s.PGSQL.{parts.port or 5432}"


async def select_one(sessions: database.GatedSessions) -> None:
    async with sessions.begin() as session:
        await session.execute(text("SELECT 1"))


async def fails_soon(sessions: database.GatedSessions) -> float:
    """How long a query took to fail; the test fails if it hangs (or succeeds)."""
    started = time.monotonic()
    task = asyncio.create_task(select_one(sessions))
    done, _ = await asyncio.wait({task}, timeout=HANG_S)
    if not done:
        task.cancel()
        pytest.fail(f"a query across a partition hung for {HANG_S:.0f} s")
    assert isinstance(task.exception(), database.OUTAGE_ERRORS), task.exception()
    return time.monotonic() - started


async def test_a_partitioned_postgres_is_an_outage_within_seconds(database_url: str) -> None:
    if "host=" not in database_url:
        pytest.skip("the relay forwards to the embedded server's Unix socket")
    relay = await netfault.Relay(socket_of(database_url)).start()
    url = over_tcp(database_url, relay.port)
    engine, sessions = database.create_async_sessions(url, pool_size=1)
    try:
        await select_one(sessions)  # a pooled connection, open when the partition begins
        with netfault.partition(relay.port):
            pooled_s = await fails_soon(sessions)  # (pre-ping, or the query, on the dead one)
            fresh_s = await fails_soon(sessions)  # a new connection: the SYN goes unanswered
        await select_one(sessions)  # healed: the next transaction works again
    finally:
        netfault.clear_partitions()
        await engine.dispose()
        await relay.close()
    assert pooled_s < HANG_S and fresh_s < HANG_S
