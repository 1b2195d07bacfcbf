"""A Postgres that hangs without closing (a paused container, a frozen VM; here its processes
stopped with SIGSTOP: the kernel still answers TCP, so no timeout of the connection fires) holds
a write no longer than its deadline and a second of grace (core/database.py `write_deadline`).
Found by tests/deploy/test_compose.py's `docker pause`: psycopg, cancelled at the deadline, asked
the
frozen server to cancel the query for 5 s and waited 5 s more for it to end, so the writer
journaled nothing for the write timeout plus 10 s, and a kill in that window lost all of it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from core import database
from demo.vllm_server import free_port
from fakes.pg import OwnPostgres

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PSYCOPG_ALONE_S = 10.0  # what psycopg's cancellation of a query added, on a frozen server


@pytest.fixture
def own_pg(tmp_path: Path) -> Any:
    pg = OwnPostgres(tmp_path, tcp_port=free_port())
    yield pg
    pg.close()


async def select_one(sessions: database.GatedSessions) -> None:
    async with sessions.begin() as session:
        await session.execute(text("SELECT 1"))


@pytest.mark.slow
async def test_a_write_to_a_frozen_postgres_ends_a_second_after_its_deadline(own_pg: Any) -> None:
    engine, sessions = database.create_async_sessions(own_pg.url, pool_size=1)
    try:
        await select_one(sessions)  # a pooled connection, open when the server freezes
        with own_pg.frozen():
            started = time.monotonic()
            with pytest.raises(database.OUTAGE_ERRORS):
                async with database.write_deadline(1.0):
                    await select_one(sessions)
            took = time.monotonic() - started
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0  # the second cancel was undone
        await select_one(sessions)  # thawed: the next write works (a new connection)
    finally:
        await engine.dispose()
    assert took < 1 + PSYCOPG_ALONE_S / 2, took  # before: 11.0 s


async def test_a_write_that_ends_in_time_is_untouched(own_pg: Any) -> None:
    engine, sessions = database.create_async_sessions(own_pg.url, pool_size=1)
    try:
        async with database.write_deadline(5.0):
            await select_one(sessions)
        await asyncio.sleep(0)  # nothing left to fire
    finally:
        await engine.dispose()


@pytest.mark.slow
def test_the_writer_journals_a_frozen_postgres_calls_a_second_after_its_timeout(
    own_pg: Any, make_proxy: Any
) -> None:
    """What a kill -9 would lose (the unsaved gauge) falls to 0 once the write timeout and a
    second have passed, not 10 s later; the journaled call is stored once the server resumes."""
    proxy = make_proxy(database_url=own_pg.url, writer_write_timeout_s=1)

    with proxy.client(**{"X-Episode-Id": "before"}) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'before'", 1)
    with own_pg.frozen():
        with proxy.client(**{"X-Episode-Id": "frozen"}) as c:
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        answered = time.monotonic()
        while (
            proxy.gauge("flywheel_writer_unsaved_transitions") > 0
            and time.monotonic() - answered < 30
        ):
            time.sleep(0.1)
        took = time.monotonic() - answered
    assert took < 1 + PSYCOPG_ALONE_S / 2, took  # before: ~11 s (write timeout + psycopg's 10)
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'frozen'", 1, timeout=30)
