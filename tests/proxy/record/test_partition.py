"""A Postgres behind a network partition (packets dropped, the connection never closed) is an
error within seconds, not a hang: the proxy's engine connects with a timeout and TCP timeouts
(core/database.py TCP_OPTIONS). Seen in bench/chaos.py pg-partition: rewards hung past every
client's timeout while their transaction waited on a dead connection."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import text

from core import database
from demo.vllm_server import free_port
from fakes import netfault
from fakes.pg import OwnPostgres

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("iptables"),
    reason="a partition drops packets with iptables (root)",
)
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_reward_posted_into_a_partition_is_journaled_within_the_write_timeout(
    tmp_path: Path, make_proxy: Any
) -> None:
    """bench/chaos.py pg-partition: the first reward posted after the partition began waited on
    the writer, then on a dead pooled connection (libpq's 10 s) and a new one (5 s), and answered
    202 after 35 s, past its client's 30 s. Its transaction is bounded like the writer's now.
    (psycopg logs "query cancellation failed" here: it cannot reach the server to cancel.)"""
    pg = OwnPostgres(tmp_path, tcp_port=free_port())
    try:
        proxy = make_proxy(database_url=pg.url, writer_write_timeout_s=1)
        with proxy.client(**{"X-Episode-Id": "cut"}) as c:
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
            proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'cut'", 1)
            with netfault.partition(pg.tcp_port):  # its transitions all stored: no wait
                started = time.monotonic()
                r = c.post("/v1/rewards", json={"episode_id": "cut", "reward": 1.0}, timeout=60)
                took = time.monotonic() - started
        assert r.status_code == 202, r.text
        # The write timeout and a second of grace (core/database.py write_deadline); before:
        # psycopg's cancel of the query (up to 5 s to ask, 5 s to see it end), and before that
        # libpq's 10 s and a new connection's 5 s.
        assert took < 1 + 5, took
    finally:
        netfault.clear_partitions()
        pg.close()
