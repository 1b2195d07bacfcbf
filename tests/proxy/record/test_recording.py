"""What the proxy records, and that the client sees exactly what vLLM would have sent it."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy

CHAT = {
    "model": "demo",
    "messages": [{"role": "user", "content": "What is 3 + 4?"}],
    "max_tokens": 5,
}


def transitions(proxy: RunningProxy, episode: str, expected: int) -> list[tuple]:
    return proxy.wait_rows(
        "SELECT id::text, status, choice_index, completion_tokens, policy_version, task_id, "
        "agent_name FROM transition WHERE episode_id = %s ORDER BY choice_index",
        expected,
        episode,
    )


def test_chat_is_recorded_with_token_ids_and_stripped_for_the_client(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    with proxy.client(**{"X-Episode-Id": "e1", "X-Task-Id": "t1", "X-Agent-Name": "solver"}) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    # The client asked for neither: vLLM would have sent them as null.
    assert body["choices"][0]["logprobs"] is None
    assert body["choices"][0]["token_ids"] is None
    assert body["prompt_token_ids"] is None
    # ...but the proxy asked vLLM for both.
    sent = fake_vllm.requests[-1]["body"]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert r.headers["x-episode-id"] == "e1"
    assert r.headers["x-policy-version"] == "none"  # "demo" by name is not the policy alias
    [row] = transitions(proxy, "e1", 1)
    assert row[0] == r.headers["x-transition-id"]
    assert row[1:] == ("ok", 0, 5, None, "t1", "solver")

    episode = proxy.client().get("/v1/episodes/e1", params={"tokens": "true"}).json()
    [t] = episode["transitions"]
    assert t["text"] == body["choices"][0]["message"]["content"]
    assert t["messages"] == CHAT["messages"]
    assert len(t["completion_token_ids"]) == len(t["logprobs"]) == 5
    assert t["prompt_token_ids"]


def test_token_ids_recorded_equal_what_vllm_returned(proxy: RunningProxy) -> None:
    with proxy.client(**{"X-Episode-Id": "e2"}) as c:
        body = c.post(
            "/v1/chat/completions", json={**CHAT, "return_token_ids": True, "logprobs": True}
        ).json()
    episode = proxy.client().get("/v1/episodes/e2?tokens=true").json()
    [t] = episode["transitions"]
    assert t["prompt_token_ids"] == body["prompt_token_ids"]
    assert t["completion_token_ids"] == body["choices"][0]["token_ids"]
    # vLLM computes logprobs in float32; the proxy stores float32: nothing is lost.
    expected = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
    assert t["logprobs"] == [struct.unpack("f", struct.pack("f", x))[0] for x in expected]


def test_n_choices_give_one_transition_each(proxy: RunningProxy) -> None:
    with proxy.client(**{"X-Episode-Id": "e3"}) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "n": 3})
    ids = r.headers["x-transition-id"].split(",")
    assert len(ids) == 3 and len(set(ids)) == 3
    rows = transitions(proxy, "e3", 3)
    assert [row[0] for row in rows] == ids
    assert [row[2] for row in rows] == [0, 1, 2]


def test_streaming_chat_is_recorded_when_the_stream_ends(proxy: RunningProxy) -> None:
    events = []
    with (
        proxy.client(**{"X-Episode-Id": "e4"}) as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        ) as r,
    ):
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] is None
    assert all(ch["choices"][0].get("token_ids") is None for ch in chunks if ch["choices"])
    assert "usage" in chunks[-1] and chunks[-1]["choices"] == []
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    [t] = proxy.client().get("/v1/episodes/e4?tokens=true").json()["transitions"]
    assert t["status"] == "ok" and t["text"] == text
    assert len(t["completion_token_ids"]) == 5 and len(t["logprobs"]) == 5 and t["prompt_token_ids"]


def read_until_end_event(lines: Iterator[str]) -> None:
    """Read a stream up to its terminal event ([DONE], or the Responses API's
    `response.completed`), and no further: the stream itself may not have ended yet. (The caller
    holds `lines`: a line iterator dropped early closes the connection.)"""
    event = ""
    for line in lines:
        if line.startswith("event: "):
            event = line
        elif line == "data: [DONE]" or event == "event: response.completed":
            return
    raise AssertionError("the stream ended without its terminal event")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("end_delay_s", [0.0, 1.0])
@pytest.mark.slow
def test_a_stream_is_recorded_before_its_end_event_reaches_the_client(
    proxy: RunningProxy, fake_vllm: FakeVLLM, route: str, end_delay_s: float
) -> None:
    """A step reward posted (or the episode read) the moment the client reads a stream's end
    event always finds the transition. vLLM may end the stream (its chunked terminator) a while
    after that event: `end_delay_s` makes that wait long enough to be seen every time."""
    fake_vllm.end_delay_s = end_delay_s
    body: dict[str, Any] = {"model": "demo", "stream": True}
    if route == "/v1/responses":
        body |= {"input": "What is 3 + 4?", "max_output_tokens": 5}
    else:
        body |= {"messages": CHAT["messages"], "max_tokens": 5}
    rounds = 3 if end_delay_s else 20
    with proxy.client() as c, proxy.client() as other:
        for n in range(rounds):
            episode = f"end-{n}"
            with c.stream("POST", route, json=body, headers={"X-Episode-Id": episode}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                read_until_end_event(lines)
                [transition_id] = r.headers["x-transition-id"].split(",")
                reward = {"episode_id": episode, "transition_id": transition_id, "reward": 1.0}
                posted = other.post("/v1/rewards", json=reward)
                assert posted.status_code == 200, posted.text
                assert posted.json()["status"] == "accepted", posted.json()
                read = other.get(f"/v1/episodes/{episode}").json()
                assert [t["id"] for t in read["transitions"]] == [transition_id]
                assert [t["status"] for t in read["transitions"]] == ["ok"]
                assert not [line for line in lines if line]  # nothing after the end event


def test_completions_route_records_each_prompt(proxy: RunningProxy) -> None:
    with proxy.client(**{"X-Episode-Id": "e5"}) as c:
        r = c.post(
            "/v1/completions",
            json={"model": "demo", "prompt": ["a b", "c d"], "n": 2, "max_tokens": 3},
        )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    episode = proxy.client().get("/v1/episodes/e5?tokens=true").json()
    assert len(episode["transitions"]) == 4
    prompts = [t["messages"][0]["prompt"] for t in episode["transitions"]]
    assert sorted(prompts) == ["a b", "a b", "c d", "c d"]
    assert all(
        len(t["completion_token_ids"]) == 3 == len(t["logprobs"]) for t in episode["transitions"]
    )


def test_upstream_errors_pass_through_unchanged_and_are_recorded_failed(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    error = {"error": {"message": "boom", "type": "BadRequestError", "param": None, "code": 400}}
    fake_vllm.fail_next(1, status=400, body=error)
    with proxy.client(**{"X-Episode-Id": "e6"}) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400 and r.json() == error
    [row] = transitions(proxy, "e6", 1)
    assert row[1] == "failed"


def test_a_failed_call_of_n_choices_stores_every_id_it_answered_with(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    """Found by bench/fuzz.py: the answer named n transition ids, one was stored."""
    fake_vllm.fail_next(1, status=500, body={"error": {"message": "engine died"}})
    with proxy.client(**{"X-Episode-Id": "n-failed"}) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "n": 3})
    assert r.status_code == 500
    ids = r.headers["x-transition-id"].split(",")
    rows = proxy.wait_rows(
        "SELECT id::text, status, choice_index FROM transition WHERE episode_id = 'n-failed' "
        "ORDER BY choice_index",
        3,
    )
    assert rows == [(i, "failed", n) for n, i in enumerate(ids)]


def test_client_disconnect_mid_stream_aborts_upstream_and_records_aborted(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    fake_vllm.token_delay_s = 0.2
    with (
        proxy.client(**{"X-Episode-Id": "gone"}) as c,
        c.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 50, "stream": True}
        ) as r,
    ):
        for line in r.iter_lines():
            if '"content"' in line:
                break  # leave after the first token: closes the connection
    rows = proxy.wait_rows("SELECT status FROM transition WHERE episode_id = 'gone'", 1)
    assert rows == [("aborted",)]
    [t] = proxy.client().get("/v1/episodes/gone?tokens=true").json()["transitions"]
    assert len(t["completion_token_ids"]) < 50  # vLLM stopped generating early


def test_upstream_timeout_is_504_and_recorded_failed(make_proxy: Any, fake_vllm: FakeVLLM) -> None:
    proxy = make_proxy(upstream_timeout_s=0.3)
    fake_vllm.latency_s = 2.0
    r = proxy.client(**{"X-Episode-Id": "slow"}).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert proxy.wait_rows("SELECT status, http_status FROM transition", 1) == [("failed", 504)]


def test_unreachable_upstream_is_502(make_proxy: Any) -> None:
    proxy = make_proxy(upstream=["http://127.0.0.1:9"], base_model="demo")
    r = proxy.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    assert proxy.wait_rows("SELECT status FROM transition", 1) == [("failed",)]


def test_multi_turn_history_is_stored_once(proxy: RunningProxy) -> None:
    system = {"role": "system", "content": "You are a calculator. " * 50}
    history = [system, {"role": "user", "content": "2+2?"}]
    with proxy.client(**{"X-Episode-Id": "multi"}) as c:
        for turn in range(4):
            r = c.post("/v1/chat/completions", json={**CHAT, "messages": history})
            history = [
                *history,
                r.json()["choices"][0]["message"],
                {"role": "user", "content": f"and {turn}?"},
            ]
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'multi'", 4)
    # 4 prompts of 2, 4, 6, 8 messages = 20 references, but only 8 distinct messages.
    assert proxy.query("SELECT count(*) FROM message")[0][0] == 8
    [[refs]] = proxy.query("SELECT sum(cardinality(message_digests)) FROM transition")
    assert refs == 20
    transitions = proxy.client().get("/v1/episodes/multi").json()["transitions"]
    assert transitions[-1]["messages"][0] == system and len(transitions[-1]["messages"]) == 8


def test_streaming_n_choices_are_recorded_apart(proxy: RunningProxy) -> None:
    with (
        proxy.client(**{"X-Episode-Id": "sn"}) as c,
        c.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "n": 2, "stream": True, "logprobs": True}
        ) as r,
    ):
        ids = r.headers["x-transition-id"].split(",")
        chunks = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["delta"].get("content"):
                assert choice["logprobs"]["content"]  # asked for: kept
    transitions = proxy.client().get("/v1/episodes/sn?tokens=true").json()["transitions"]
    assert [t["id"] for t in transitions] == ids
    assert [t["text"] for t in transitions] == [texts[0], texts[1]]
    assert all(len(t["completion_token_ids"]) == 5 == len(t["logprobs"]) for t in transitions)


def test_a_very_long_prompt_streams_and_records(proxy: RunningProxy) -> None:
    """vLLM's first SSE chunk carries every prompt token id: far beyond any line buffer."""
    long = {"role": "user", "content": "word " * 300_000}  # first chunk ~1.5 MB
    with (
        proxy.client(**{"X-Episode-Id": "long"}) as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            json={**CHAT, "messages": [long], "stream": True, "return_token_ids": True},
        ) as r,
    ):
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        prompt_ids = orjson.loads(first[6:])["prompt_token_ids"]
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert len(first) > 1_000_000
    [t] = proxy.client().get("/v1/episodes/long?tokens=true").json()["transitions"]
    assert t["status"] == "ok" and t["prompt_token_ids"] == prompt_ids


def test_random_uuids_are_version_4_and_distinct() -> None:
    from proxy.relay.call import random_uuids

    ids = random_uuids(500)
    parsed = [uuid.UUID(i) for i in ids]
    assert [str(u) for u in parsed] == ids and len(set(ids)) == 500
    assert {(u.version, u.variant) for u in parsed} == {(4, uuid.RFC_4122)}


def test_a_null_message_is_recorded_not_rejected(proxy: RunningProxy) -> None:
    """Found by bench/fuzz.py: `null` among the messages (vLLM refuses the call) made the
    message row SQL NULL, Postgres refused it, and the failed transition went to rejected/."""
    with proxy.client(**{"X-Episode-Id": "null-message"}) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "messages": [None]})
    assert r.status_code == 400 and r.headers["x-transition-id"]
    assert proxy.wait_rows("SELECT status FROM transition", 1) == [("failed",)]
    [t] = proxy.client().get("/v1/episodes/null-message").json()["transitions"]
    assert t["messages"] == [None]
