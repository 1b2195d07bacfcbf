"""Rewards through an outage (issue 31): a reward posted while Postgres is down is journaled and
answered 202, applied when the journal is replayed (after the transitions it names), its
idempotency key honoured across the outage; a bad post is still refused at once.

Uses its own embedded PostgreSQL, stopped with `pg_ctl stop -m fast` as in
tests/proxy/record/test_outage.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest

from core import database
from proxy.record import reward_journal
from proxy.record.journal import Journal
from tests.conftest import RunningProxy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def wait_for(condition: Callable[[], Any], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def health(proxy: RunningProxy) -> dict[str, Any]:
    return httpx.get(proxy.url + "/healthz").json()  # type: ignore[no-any-return]


def call(proxy: RunningProxy, episode_id: str) -> str:
    with proxy.client(**{"X-Episode-Id": episode_id}) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    return r.headers["x-transition-id"]


def post(proxy: RunningProxy, body: Any) -> httpx.Response:
    with proxy.client() as c:
        return c.post("/v1/rewards", json=body)


@pytest.mark.slow
def test_a_reward_posted_during_an_outage_is_journaled_and_stored_after_it(
    own_postgres: Any, make_proxy: Any
) -> None:
    proxy = make_proxy(database_url=own_postgres.url, journal_retry_s=0.2)
    before = [call(proxy, "ep"), call(proxy, "ep")]
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'ep'", 2)

    own_postgres.stop()
    during = call(proxy, "ep")  # recorded while Postgres is down: journaled
    wait_for(lambda: health(proxy)["database"] != "up")
    final = {"episode_id": "ep", "reward": 1.0, "idempotency_key": "final"}
    r = post(proxy, final)
    assert r.status_code == 202, r.text
    assert r.json() == {
        "object": "reward",
        "episode_id": "ep",
        "transition_id": None,
        "reward": 1.0,
        "source": None,
        "status": "journaled",
        "stored": False,
        "credited_transitions": 0,
    }
    assert post(proxy, final).status_code == 202  # the same key again: stored once
    step = {"episode_id": "ep", "transition_id": during, "reward": 0.5, "idempotency_key": "s"}
    listed = post(proxy, [step, {"episode_id": "ep", "reward": 0.25, "source": "judge"}])
    assert listed.status_code == 202, listed.text
    assert [d["status"] for d in listed.json()["data"]] == ["journaled", "journaled"]
    # Validation needs no database: still a 400 at once, nothing journaled.
    bad = post(proxy, {"episode_id": "ep", "reward": "high"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_reward"
    # A key reused with another value can only be known at replay: set aside there.
    assert post(proxy, {**final, "reward": -1.0}).status_code == 202

    # A graceful stop while Postgres is down keeps them on disk; the next proxy replays them.
    proxy.stop()
    journal = proxy.settings.journal_dir
    assert list(journal.glob("rewards-*.jsonl"))
    own_postgres.start()
    second = make_proxy(database_url=own_postgres.url, home=proxy.settings.home)
    wait_for(lambda: health(second)["database"] == "up")

    again = post(second, final)  # once during the outage, once after: a duplicate
    assert again.status_code == 200 and again.json()["status"] == "duplicate", again.text
    assert again.json()["stored"] is True
    rewards = second.query(
        "SELECT idempotency_key, value, transition_id::text, source FROM reward "
        "WHERE episode_id = 'ep' ORDER BY value"
    )
    assert [(k, v, t) for k, v, t, _ in rewards if not k.startswith("auto:")] == [
        ("s", 0.5, during),  # joined to the transition it names: replayed after it
        ("final", 1.0, None),
    ]
    assert [(v, s) for k, v, _, s in rewards if k.startswith("auto:")] == [(0.25, "judge")]
    episode = second.query("SELECT final_reward FROM episode WHERE id = 'ep'")
    assert episode == [(0.25,)]  # the later final reward of the list replaced the first
    credited = second.query(
        "SELECT id::text FROM transition WHERE episode_id = 'ep' AND \"return\" IS NOT NULL"
    )
    assert sorted(t for (t,) in credited) == sorted([*before, during])
    refused = [orjson.loads(p.read_bytes()) for p in (journal / "rejected").iterdir()]
    assert len(refused) == 1 and "KeyReused" in refused[0]["error"]
    assert refused[0]["post"]["rewards"][0]["reward"] == -1.0


def test_replay_applies_a_reward_only_after_the_transitions_journaled_before_it(
    tmp_path: Path,
) -> None:
    journal = Journal(tmp_path)
    journal.append_rewards([{"rewards": []}])
    first_transitions = tmp_path / f"segment-{time.time_ns():020d}-1-000001.jsonl"
    first_transitions.write_bytes(b"")
    journal.append_rewards([{"rewards": []}])
    older, newer = journal.reward_segments()
    assert journal.reward_segments(before=[first_transitions]) == [older]
    assert journal.reward_segments(before=[]) == [older, newer]


async def test_a_damaged_reward_line_is_quarantined_and_a_malformed_post_set_aside(
    tmp_path: Path,
) -> None:
    """Neither stops the replay (no database is reached: both fail before it)."""
    journal = Journal(tmp_path)
    journal.append_rewards([{"posted_at": 0, "rewards": "not a list"}])
    (segment,) = journal.reward_segments()
    segment.write_bytes(segment.read_bytes() + b'{"posted_at": 1, "rewa\n')
    journal.pending += 1
    assert await reward_journal.replay_rewards(journal, None, gamma=None, timeout_s=1)  # type: ignore[arg-type]
    assert journal.pending == 0 and not journal.reward_segments()
    assert (journal.quarantine_dir / segment.name).exists()
    (kept,) = [orjson.loads(p.read_bytes()) for p in journal.rejected_dir.iterdir()]
    assert kept["post"]["rewards"] == "not a list" and "validation error" in kept["error"]


async def test_replay_applies_journaled_posts_in_batches_judging_repeated_keys_as_posted(
    tmp_path: Path, database_url: str
) -> None:
    """bench/chaos.py pg-stop (60 s, 8 clients): 28,896 reward posts journaled, one transaction
    each at replay, far slower than they came; 120 s after the traffic stopped 22,720 were still
    waiting. Now consecutive posts share a transaction, and a repeated key starts a new one so
    that it is judged as it was when posted (a duplicate, or a key reused: rejected/)."""
    journal = Journal(tmp_path)
    posts = [
        {
            "posted_at": 0,
            "rewards": [{"episode_id": f"b{i}", "reward": 1.0, "idempotency_key": "f"}],
        }
        for i in range(2500)
    ]
    posts[1200]["rewards"][0]["episode_id"] = "b7"  # the same key and value: a duplicate
    posts[2000]["rewards"][0].update(episode_id="b8", reward=-1.0)  # reused: set aside
    for post in posts:
        journal.append_rewards([post])
    engine, sessionmaker = database.create_async_sessions(database_url)
    try:
        with psycopg.connect(database_url, autocommit=True) as db:
            before = commits(db)
            assert await reward_journal.replay_rewards(
                journal, sessionmaker, gamma=None, timeout_s=15
            )
            transactions = commits(db) - before
            stored = db.execute("SELECT episode_id, value FROM reward").fetchall()
    finally:
        await engine.dispose()
    # 2,500 one post at a time; the reused key is found by halving its batch (with pings)
    assert transactions <= 60, transactions
    assert len(stored) == 2498 and ("b8", -1.0) not in stored
    (kept,) = [orjson.loads(p.read_bytes()) for p in journal.rejected_dir.iterdir()]
    assert "KeyReused" in kept["error"] and kept["post"]["rewards"][0]["episode_id"] == "b8"
    assert journal.pending == 0


def commits(db: psycopg.Connection[Any]) -> int:
    row = db.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    db.execute("SELECT pg_stat_clear_snapshot()")
    return int(row[0])  # type: ignore[index]


def test_a_reward_whose_commit_landed_unseen_is_stored_once_after_replay(
    make_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by reading: a live write that times out during COMMIT may have landed; it is
    journaled and replayed. An unkeyed reward got its key only when journaled, so the replay
    stored it again and a step reward's return doubled. Every reward is keyed before its first
    attempt now, and the replay finds it a duplicate."""
    from proxy.routes import rewards as route

    proxy = make_proxy(journal_retry_s=0.2)
    step = call(proxy, "unseen")
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'unseen'", 1)
    real = route.rewards.add_rewards

    async def lands_then_times_out(items: Any, *, session: Any, **kw: Any) -> Any:
        async with proxy.services.writer_sessions.begin() as own:  # COMMIT goes through...
            await real(items, session=own, **kw)
        raise TimeoutError("COMMIT unanswered")  # ...and its answer is lost

    monkeypatch.setattr(route.rewards, "add_rewards", lands_then_times_out)
    r = post(proxy, {"episode_id": "unseen", "transition_id": step, "reward": 0.5})
    assert r.status_code == 202 and r.json()["status"] == "journaled", r.text
    monkeypatch.setattr(route.rewards, "add_rewards", real)
    wait_for(lambda: proxy.services.recorder.journal.pending == 0)
    stored = "SELECT count(*), sum(value) FROM reward WHERE episode_id = 'unseen'"
    assert proxy.query(stored) == [(1, 0.5)]


async def test_a_final_reward_replayed_after_a_newer_one_does_not_replace_it(
    make_proxy: Any, tmp_path: Path
) -> None:
    """Found by reading: proxy A journals a final reward of 1.0 while cut off, proxy B stores a
    corrected 0.0, and A's replay set 1.0 over it. The last *posted* final reward wins now; the
    stale one is kept in the history."""
    proxy = make_proxy()
    call(proxy, "late")
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'late'", 1)
    cut_off = Journal(tmp_path / "proxy-a")  # A's journal: 1.0, posted a minute ago
    stale = {"episode_id": "late", "reward": 1.0, "idempotency_key": "a"}
    cut_off.append_rewards([{"posted_at": time.time() - 60, "rewards": [stale]}])
    assert post(proxy, {"episode_id": "late", "reward": 0.0}).status_code == 200  # through B

    async def replay() -> None:  # A's journal, as A's writer replays it
        engine, sessionmaker = database.create_async_sessions(proxy.database_url)
        try:
            assert await reward_journal.replay_rewards(
                cut_off, sessionmaker, gamma=None, timeout_s=15
            )
        finally:
            await engine.dispose()

    await replay()
    assert proxy.query("SELECT final_reward FROM episode WHERE id = 'late'") == [(0.0,)]
    history = "SELECT value FROM reward WHERE episode_id = 'late' ORDER BY value"
    assert proxy.query(history) == [(0.0,), (1.0,)]
    returns = "SELECT DISTINCT \"return\" FROM transition WHERE episode_id = 'late'"
    assert proxy.query(returns) == [(0.0,)]
    # A newer post still replaces it, live or replayed.
    newer = {"episode_id": "late", "reward": 0.5, "idempotency_key": "b"}
    cut_off.append_rewards([{"posted_at": time.time() + 1, "rewards": [newer]}])
    await replay()
    assert proxy.query("SELECT final_reward FROM episode WHERE id = 'late'") == [(0.5,)]


@pytest.mark.slow
def test_database_up_reads_0_while_only_rewards_wait_for_a_database_that_is_down(
    own_postgres: Any, make_proxy: Any
) -> None:
    """Found by reading: with only reward posts journaled, the replay found no transitions to
    write and set flywheel_database_up to 1 without reaching Postgres."""
    proxy = make_proxy(database_url=own_postgres.url, journal_retry_s=0.2)
    call(proxy, "down")
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'down'", 1)

    own_postgres.stop()
    try:
        r = post(proxy, {"episode_id": "down", "reward": 1.0})
        assert r.status_code == 202, r.text
        time.sleep(1.5)  # several replay attempts (journal_retry_s 0.2)
        assert proxy.services.recorder.journal.pending == 1
        assert proxy.gauge("flywheel_database_up") == 0.0
    finally:
        own_postgres.start()
    wait_for(lambda: proxy.services.recorder.journal.pending == 0)
    assert proxy.gauge("flywheel_database_up") == 1.0
    assert proxy.query("SELECT final_reward FROM episode WHERE id = 'down'") == [(1.0,)]
