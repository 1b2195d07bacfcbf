"""Rewards: final and intermediate, idempotency, replacement, conflicts, and credit."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import RunningProxy

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
    again = post(proxy, {**body, "reward": 0.0})
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    assert returns(proxy, "idem") == {tid: 1.0}
    assert proxy.query("SELECT count(*) FROM reward")[0][0] == 1


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


def test_a_list_is_all_or_nothing(proxy: RunningProxy) -> None:
    call(proxy, "atomic")
    r = post(
        proxy,
        [
            {"episode_id": "atomic", "reward": 1.0},
            {
                "episode_id": "atomic",
                "transition_id": "00000000-0000-4000-8000-000000000000",
                "reward": 1.0,
            },
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
    ],
)
def test_malformed_reward_bodies(proxy: RunningProxy, raw: bytes) -> None:
    r = proxy.client().post(
        "/v1/rewards", content=raw, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
