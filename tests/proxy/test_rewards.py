"""Rewards: final and intermediate, idempotency, replacement, conflicts, and credit."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path
from typing import Any

import pytest

from core import database
from demo.vllm_server import free_port
from tests.conftest import RunningProxy
from tests.proxy.record.test_air import ASK

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def call(proxy: RunningProxy, episode: str, **extra: Any) -> list[str]:
    with proxy.client(**{"X-Episode-Id": episode, "X-Task-Id": "task"}) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 200, r.text
    return r.headers["x-transition-id"].split(",")


def returns(proxy: RunningProxy, episode: str) -> dict[str, float | None]:
    rows = proxy.query('SELECT id::text, "return" FROM transition WHERE episode_id = %s', episode)
    return dict(rows)


def post(proxy: RunningProxy, body: Any) -> Any:
    return proxy.client().post("/v1/rewards", json=body)


def test_a_reward_right_after_the_response_credits_every_transition(proxy: RunningProxy) -> None:
    ids = call(proxy, "ep") + call(proxy, "ep", n=2)
    r = post(proxy, {"episode_id": "ep", "reward": 1.0})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "accepted" and r.json()["credited_transitions"] == 3
    assert returns(proxy, "ep") == dict.fromkeys(ids, 1.0)


def test_a_reward_before_the_transitions_is_kept_and_joined_later(proxy: RunningProxy) -> None:
    assert post(proxy, {"episode_id": "early", "reward": 0.5}).json()["credited_transitions"] == 0
    [tid] = call(proxy, "early")
    rows = proxy.wait_rows(
        'SELECT "return" FROM transition WHERE id = %s AND "return" IS NOT NULL', 1, tid
    )
    assert rows == [(0.5,)]


def test_intermediate_rewards_add_to_their_own_step(proxy: RunningProxy) -> None:
    first, second = call(proxy, "steps")[0], call(proxy, "steps")[0]
    r = post(
        proxy,
        [
            {"episode_id": "steps", "transition_id": second, "reward": 0.25},
            {"episode_id": "steps", "reward": 1.0},
        ],
    )
    assert r.status_code == 200, r.text
    assert [x["status"] for x in r.json()["data"]] == ["accepted", "accepted"]
    assert returns(proxy, "steps") == {first: 1.0, second: 1.25}


def test_discounted_credit(make_proxy: Any) -> None:
    proxy = make_proxy(credit_gamma=0.5)
    first, second = call(proxy, "disc")[0], call(proxy, "disc")[0]
    post(proxy, {"episode_id": "disc", "reward": 1.0})
    assert returns(proxy, "disc") == {first: 0.5, second: 1.0}


def test_the_same_idempotency_key_changes_nothing(proxy: RunningProxy) -> None:
    [tid] = call(proxy, "idem")
    body = {"episode_id": "idem", "reward": 1.0, "idempotency_key": "k1"}
    assert post(proxy, body).json()["status"] == "accepted"
    again = post(proxy, body)
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    # The key with another value is a mistake in the client, not a retry: said, not dropped.
    reused = post(proxy, {**body, "reward": 0.0})
    assert reused.status_code == 409, reused.text
    assert reused.json()["error"]["code"] == "idempotency_key_reused"
    assert reused.json()["error"]["param"] == "idempotency_key"
    assert returns(proxy, "idem") == {tid: 1.0}
    assert proxy.query("SELECT count(*) FROM reward")[0][0] == 1


def test_an_idempotency_key_is_unique_per_episode_not_global(proxy: RunningProxy) -> None:
    """Issue 13, item 11: one key in two episodes is two rewards (the second was dropped)."""
    [first], [second] = call(proxy, "key-a"), call(proxy, "key-b")
    for episode in ("key-a", "key-b"):
        r = post(proxy, {"episode_id": episode, "reward": 1.0, "idempotency_key": "attempt-1"})
        assert r.json()["status"] == "accepted", r.text
    assert returns(proxy, "key-a") == {first: 1.0} and returns(proxy, "key-b") == {second: 1.0}
    both = [
        {"episode_id": e, "reward": 0.5, "idempotency_key": "attempt-2"} for e in ("key-a", "key-b")
    ]
    assert [x["status"] for x in post(proxy, both).json()["data"]] == ["accepted", "accepted"]


def test_concurrent_posts_with_one_key_store_it_once_without_a_5xx(proxy: RunningProxy) -> None:
    """Issue 13, item 11: the race of two posts with one key was an IntegrityError (500)."""
    episodes = ["race-a", "race-b"]
    for e in episodes:
        call(proxy, e)
    bodies = [
        {"episode_id": e, "reward": 1.0, "idempotency_key": "same"}
        for e in episodes
        for _ in range(6)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post(proxy, b), bodies))
    assert {r.status_code for r in answers} == {200}, [r.text for r in answers]
    statuses = sorted(r.json()["status"] for r in answers)
    assert statuses == ["accepted"] * 2 + ["duplicate"] * 10
    assert proxy.query(
        "SELECT episode_id, count(*) FROM reward WHERE idempotency_key = 'same' GROUP BY 1 "
        "ORDER BY 1"
    ) == [("race-a", 1), ("race-b", 1)]


def test_a_new_final_reward_replaces_the_old_until_trained(proxy: RunningProxy) -> None:
    [tid] = call(proxy, "replace")
    post(proxy, {"episode_id": "replace", "reward": 1.0})
    assert post(proxy, {"episode_id": "replace", "reward": 0.0}).status_code == 200
    assert returns(proxy, "replace") == {tid: 0.0}

    proxy.query("UPDATE transition SET trained_at = now() WHERE id = %s RETURNING id", tid)
    conflict = post(proxy, {"episode_id": "replace", "reward": 1.0})
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "already_trained"
    assert returns(proxy, "replace") == {tid: 0.0}
    # Posting the same value again is harmless.
    assert post(proxy, {"episode_id": "replace", "reward": 0.0}).status_code == 200
    # So is a step reward that changes no trained return; one that does is refused.
    step = {"episode_id": "replace", "transition_id": tid}
    assert post(proxy, {**step, "reward": 0.0}).status_code == 200
    refused = post(proxy, {**step, "reward": 0.5})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "already_trained"
    assert returns(proxy, "replace") == {tid: 0.0}


def test_a_step_reward_may_not_change_an_earlier_trained_return(make_proxy: Any) -> None:
    """Discounted credit: a later step's reward flows back into earlier returns. If an earlier
    transition was trained, its return may no longer change (it was silently left stale)."""
    proxy = make_proxy(credit_gamma=0.5)
    first, second = call(proxy, "flow")[0], call(proxy, "flow")[0]
    post(proxy, {"episode_id": "flow", "reward": 1.0})
    proxy.query("UPDATE transition SET trained_at = now() WHERE id = %s RETURNING id", first)
    r = post(proxy, {"episode_id": "flow", "transition_id": second, "reward": 1.0})
    assert r.status_code == 409 and r.json()["error"]["code"] == "already_trained", r.text
    assert returns(proxy, "flow") == {first: 0.5, second: 1.0}
    assert proxy.query("SELECT count(*) FROM reward WHERE transition_id IS NOT NULL") == [(0,)]


def test_a_list_is_all_or_nothing(proxy: RunningProxy) -> None:
    call(proxy, "atomic")
    [elsewhere] = call(proxy, "another-episode")
    r = post(
        proxy,
        [
            {"episode_id": "atomic", "reward": 1.0},
            {"episode_id": "atomic", "transition_id": elsewhere, "reward": 1.0},
        ],
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "transition_not_found"
    assert proxy.query("SELECT count(*) FROM reward")[0][0] == 0
    assert set(returns(proxy, "atomic").values()) == {None}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"episode_id": "e", "reward": "1"}, "reward"),
        ({"episode_id": "e", "reward": True}, "reward"),
        ({"episode_id": "e"}, "reward"),
        ({"reward": 1.0}, "episode_id"),
        ({"episode_id": "has space", "reward": 1.0}, "episode_id"),
        ({"episode_id": "e", "reward": 1.0, "transition_id": "not-a-uuid"}, "transition_id"),
        ({"episode_id": "e", "reward": 1.0, "colour": "red"}, "colour"),
        ([{"episode_id": "e", "reward": 1.0}, {"episode_id": "e", "reward": None}], "[1].reward"),
    ],
)
def test_bad_rewards_get_a_clear_400_and_store_nothing(
    proxy: RunningProxy, body: Any, param: str
) -> None:
    r = post(proxy, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    assert proxy.query("SELECT count(*) FROM reward")[0][0] == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[]",
        b"NaN",
        b'{"episode_id": "e", "reward": NaN}',
        b'{"episode_id": "e", "reward": 1e999}',
        b'{"episode_id": "e", "reward": -Infinity}',
        # Finite but beyond MAX_ABS_REWARD: two of them once overflowed the dashboard's mean.
        b'{"episode_id": "e", "reward": 1e308}',
        b'{"episode_id": "e", "reward": -1.0000001e9}',
    ],
)
def test_malformed_reward_bodies(proxy: RunningProxy, raw: bytes) -> None:
    r = proxy.client().post(
        "/v1/rewards", content=raw, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_step_reward_reaching_another_replica_first_is_kept_until_its_transition_is_stored(
    make_proxy: Any, tmp_path: Path
) -> None:
    """Issue 13, item 13: replica B answered 404 for a transition replica A had recorded but not
    stored yet (A's writer was journaling through a Postgres blip of its own)."""
    a, b = make_proxy(home=tmp_path / "a", journal_retry_s=0.2), make_proxy(home=tmp_path / "b")
    recorder = a.services.recorder
    reachable = recorder._sessionmaker
    dead_engine, dead = database.create_async_sessions(
        f"postgresql://nobody@127.0.0.1:{free_port()}/none"
    )
    recorder._sessionmaker = dead
    try:
        with a.client(**{"X-Episode-Id": "cross", "X-Task-Id": "t"}) as c:
            first = c.post("/v1/chat/completions", json=CHAT)
            second = c.post("/v1/chat/completions", json=ASK)
        assert first.status_code == second.status_code == 200
        tid = first.headers["x-transition-id"]
        [call_id] = [t["id"] for t in second.json()["choices"][0]["message"]["tool_calls"]]
        deadline = time.monotonic() + 10
        while not recorder.journal.pending:  # A's writer failed over to its journal
            assert time.monotonic() < deadline
            time.sleep(0.05)
        answers = [
            post(b, {"episode_id": "cross", "transition_id": tid, "reward": 0.5}),
            post(b, {"episode_id": "cross", "tool_call_id": call_id, "reward": -1.0}),
            post(b, {"episode_id": "cross", "reward": 1.0}),
        ]
        assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
        assert [r.json()["status"] for r in answers] == ["pending", "pending", "accepted"]
        assert proxy_rewards(b, "cross") == [
            ({"transition_id": tid}, None),
            ({"tool_call_id": call_id}, None),
            (None, None),
        ]
    finally:
        recorder._sessionmaker = reachable
    # A's writer replays its journal: the rewards join their transitions and count.
    b.wait_rows(
        "SELECT 1 FROM transition WHERE episode_id = 'cross' AND credited_at IS NOT NULL", 2
    )
    tool_tid = second.headers["x-transition-id"]
    assert returns(b, "cross") == {tid: 1.5, tool_tid: 0.0}
    assert proxy_rewards(b, "cross") == [(None, tid), (None, tool_tid), (None, None)]
    asyncio.run(dead_engine.dispose())


def proxy_rewards(proxy: RunningProxy, episode: str) -> list[tuple[Any, Any]]:
    rewards = proxy.client().get(f"/v1/episodes/{episode}").json()["rewards"]
    return [(r["pending"], r["transition_id"]) for r in rewards]


@pytest.mark.slow
def test_the_largest_post_is_stored_whole(proxy: RunningProxy) -> None:
    """10,000 rewards in one post (the limit) took minutes, one reward's statements at a time;
    now a few statements for all (bench/chaos.py reward-burst has the figure)."""
    [tid] = call(proxy, "burst-known")
    body = [
        {"episode_id": f"burst-{i}", "reward": 0.5, "idempotency_key": "k"} for i in range(9_998)
    ]
    body += [
        {"episode_id": "burst-known", "reward": 1.0},
        {"episode_id": "burst-known", "transition_id": tid, "reward": 0.25},
    ]
    r = proxy.client().post("/v1/rewards", json=body)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 10_000 and {d["status"] for d in data} == {"accepted"}
    assert data[-1]["credited_transitions"] == 1 and returns(proxy, "burst-known") == {tid: 1.25}
    assert proxy.query("SELECT count(*) FROM reward") == [(10_000,)]
    again = proxy.client().post("/v1/rewards", json=body[:9_998])
    assert {d["status"] for d in again.json()["data"]} == {"duplicate"}
    assert proxy.query("SELECT count(*) FROM reward") == [(10_000,)]
