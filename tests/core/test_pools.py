"""The proxy's two connection pools (issue 33): readers cannot starve the writer, and each read
statement is bounded (FLYWHEEL_READ_TIMEOUT_S) while the writer's are not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
from sqlalchemy import text

from core.database import AsyncSessions
from tests.conftest import RunningProxy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 3}
HELD_S = 30  # how long the readers' sleeps would last (they are cancelled when the test ends)


def run_in_proxy(proxy: RunningProxy, coro: Any) -> Future[Any]:
    loop = proxy.services.recorder._task.get_loop()  # type: ignore[union-attr]
    return asyncio.run_coroutine_threadsafe(coro, loop)


async def show_timeout(sessions: AsyncSessions) -> str:
    async with sessions.begin() as session:
        return str((await session.execute(text("SHOW statement_timeout"))).scalar())


@contextlib.contextmanager
def readers_all_busy(proxy: RunningProxy) -> Iterator[None]:
    """Every connection of the readers' pool (its size and as many again) in a long pg_sleep."""
    sessions = proxy.services.sessionmaker
    pool = sessions.kw["bind"].sync_engine.pool
    n = pool.size() * 2  # type: ignore[attr-defined]

    async def hold() -> None:
        async with sessions() as session:
            await session.execute(text(f"SELECT pg_sleep({HELD_S})"))

    held = [run_in_proxy(proxy, hold()) for _ in range(n)]
    # This test's database only: the server is shared with every other test (and test process).
    sleeping = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND query LIKE 'SELECT pg_sleep%%'"
    )
    try:
        proxy.wait_until(lambda: proxy.query(sleeping)[0][0] >= n, f"{n} readers asleep")
        yield
    finally:
        proxy.query(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'SELECT pg_sleep%%' "
            "AND pid <> pg_backend_pid()"
        )
        for future in held:
            with contextlib.suppress(Exception):
                future.result(timeout=10)


def test_readers_holding_every_connection_do_not_hold_up_recording_or_rewards(
    make_proxy: Any,
) -> None:
    proxy = make_proxy(writer_linger_s=0, read_timeout_s=HELD_S * 2)
    with readers_all_busy(proxy), proxy.client(**{"X-Episode-Id": "busy"}) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        # The writer's own pool: stored at once, not after a pool timeout and a journal spill.
        rows = proxy.wait_rows(
            "SELECT id::text FROM transition WHERE episode_id = 'busy'", 1, timeout=3
        )
        assert [row[0] for row in rows] == [r.headers["x-transition-id"]]
        reward = c.post("/v1/rewards", json={"episode_id": "busy", "reward": 1.0}, timeout=5)
        assert reward.status_code == 200, reward.text  # not 202: not journaled
        assert proxy.query("SELECT final_reward FROM episode WHERE id = 'busy'") == [(1.0,)]
        journal = proxy.services.recorder.journal
        assert journal.pending == 0 and journal.segments() == []


def test_a_read_past_the_read_timeout_is_a_503_that_says_what_to_narrow(
    make_proxy: Any,
) -> None:
    proxy = make_proxy(read_timeout_s=0.3)
    # Reads are bounded per transaction; the writer's sessions are not (its COPY may run long).
    assert run_in_proxy(proxy, show_timeout(proxy.services.sessionmaker)).result(5) == "300ms"
    assert run_in_proxy(proxy, show_timeout(proxy.services.writer_sessions)).result(5) == "0"
    # A slow query: every read of `transition` waits behind a lock held here.
    with psycopg.connect(proxy.database_url) as conn:
        conn.execute("LOCK TABLE transition IN ACCESS EXCLUSIVE MODE")
        try:
            overview = httpx.get(proxy.url + "/ui/api/overview", params={"hours": 1}, timeout=10)
            export = httpx.get(proxy.url + "/v1/export", timeout=10)
        finally:
            conn.rollback()
    for r, narrow in [(overview, "hours"), (export, "since/until")]:
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "query_timeout"
        assert "FLYWHEEL_READ_TIMEOUT_S" in error["message"] and narrow in error["message"]
    # Once the lock is gone the same reads answer.
    assert httpx.get(proxy.url + "/ui/api/overview", params={"hours": 1}).status_code == 200


def test_reward_posts_queued_on_one_episode_do_not_starve_the_writer(make_proxy: Any) -> None:
    """Found by reading: reward posts shared the writer's pool, so a burst of them on one episode
    (each waiting on its row lock, each holding a connection) left the writer none past its
    timeout, and every tenant's traffic went to the journal as if Postgres were down."""
    proxy = make_proxy(
        writer_linger_s=0, writer_pool_size=1, reward_pool_size=1, writer_write_timeout_s=2
    )
    with proxy.client(**{"X-Episode-Id": "hot"}) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'hot'", 1)
    bodies = [{"episode_id": "hot", "reward": float(i)} for i in range(4)]
    with psycopg.connect(proxy.database_url) as lock, ThreadPoolExecutor(4) as pool:
        lock.execute("SELECT 1 FROM episode WHERE id = 'hot' FOR UPDATE")  # held: posts queue
        posts = [
            pool.submit(httpx.post, proxy.url + "/v1/rewards", json=b, timeout=30) for b in bodies
        ]
        proxy.wait_until(
            lambda: (
                proxy.query(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )[0][0]
                >= 1
            ),
            "a reward post waiting on the episode's lock",
        )
        with proxy.client(**{"X-Episode-Id": "cold"}) as c:  # another episode's call meanwhile
            r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        stored = proxy.wait_rows(
            "SELECT id::text FROM transition WHERE episode_id = 'cold'", 1, timeout=5
        )
        assert [row[0] for row in stored] == [r.headers["x-transition-id"]]
        assert proxy.services.recorder.journal.pending == 0  # stored, not journaled
        lock.rollback()
        answers = [p.result(timeout=30) for p in posts]
    assert all(a.status_code in (200, 202) for a in answers), [a.text for a in answers]
