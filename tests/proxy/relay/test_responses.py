"""POST /v1/responses through the proxy (fake vLLM; the real one in tests/e2e/test_e2e_clients.py):
recorded as one transition per call, and the client sees exactly what vLLM would have sent it."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy

RESPONSE = {"model": "demo", "input": "What is 3 + 4?", "max_output_tokens": 5, "seed": 3}
CALCULATOR = {  # a Responses function tool (flat, not nested under "function" as in chat)
    "type": "function",
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}
TOOLS = [CALCULATOR]
RAW = {"enable_response_messages": True, "include": ["message.output_text.logprobs"]}
# What differs between two answers to the same request: generated ids and timestamps.
VOLATILE = re.compile(r'"(id|call_id|item_id|created_at)":"?[\w-]+"?')


def same_answer(a: str, b: str) -> bool:
    return VOLATILE.sub("", a) == VOLATILE.sub("", b)


def episode(proxy: RunningProxy, episode_id: str, expected: int = 1) -> list[dict[str, Any]]:
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = %s", expected, episode_id)
    r = proxy.client().get(f"/v1/episodes/{episode_id}", params={"tokens": "true"})
    return r.json()["transitions"]  # type: ignore[no-any-return]


def test_response_is_recorded_and_the_client_sees_what_vllm_would_send(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    body = {**RESPONSE, "instructions": "Answer with a number."}
    headers = {"X-Episode-Id": "r1", "X-Task-Id": "t1", "X-Agent-Name": "solver"}
    r = proxy.client(**headers).post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    sent = fake_vllm.requests[-1]["body"]
    assert sent["enable_response_messages"] is True
    assert sent["include"] == ["message.output_text.logprobs"]
    direct = httpx.post(fake_vllm.url + "/v1/responses", json=body)
    assert same_answer(r.text, direct.text)  # ids and logprobs stripped as vLLM leaves them out
    data = r.json()
    assert data["input_messages"] is None and data["top_logprobs"] is None
    assert data["output"][0]["content"][0]["logprobs"] is None

    [t] = episode(proxy, "r1")
    assert t["id"] == r.headers["x-transition-id"]
    assert (t["route"], t["status"], t["task_id"], t["agent_name"]) == (
        "responses",
        "ok",
        "t1",
        "solver",
    )
    assert t["messages"] == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    assert "input" not in t["params"] and "instructions" not in t["params"]
    assert t["text"] == data["output"][0]["content"][0]["text"]
    assert t["finish_reason"] == "length"
    assert len(t["completion_token_ids"]) == len(t["logprobs"]) == 5
    raw = httpx.post(fake_vllm.url + "/v1/responses", json={**body, **RAW}).json()
    assert t["prompt_token_ids"] == raw["input_messages"][0]["tokens"]
    assert t["completion_token_ids"] == raw["output_messages"][0]["tokens"]


def test_what_the_client_asked_for_is_passed_through(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    body = {**RESPONSE, **RAW, "include": ["reasoning.encrypted_content", *RAW["include"]]}
    r = proxy.client(**{"X-Episode-Id": "r2"}).post("/v1/responses", json=body)
    assert fake_vllm.requests[-1]["body"]["include"] == body["include"]  # not added twice
    direct = httpx.post(fake_vllm.url + "/v1/responses", json=body)
    assert same_answer(r.text, direct.text)
    data = r.json()
    [t] = episode(proxy, "r2")
    assert t["prompt_token_ids"] == data["input_messages"][0]["tokens"]
    assert t["completion_token_ids"] == data["output_messages"][0]["tokens"]
    logprobs = [e["logprob"] for e in data["output"][0]["content"][0]["logprobs"]]
    assert t["logprobs"] == pytest.approx(logprobs, rel=1e-6)


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


@pytest.mark.parametrize("detail", [{}, RAW], ids=["plain", "ids+logprobs"])
def test_stream_passes_events_through_and_records_at_the_end(
    proxy: RunningProxy, fake_vllm: FakeVLLM, detail: dict[str, Any]
) -> None:
    body = {**RESPONSE, **detail, "stream": True}
    with (
        proxy.client(**{"X-Episode-Id": "s1"}) as c,
        c.stream("POST", "/v1/responses", json=body) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    direct = httpx.post(fake_vllm.url + "/v1/responses", json=body).text
    assert same_answer(text, direct)
    events = sse(text)
    assert [name for name, _ in events] == [e["type"] for _, e in events]
    final = events[-1][1]["response"]
    [t] = episode(proxy, "s1")
    assert t["status"] == "ok" and t["params"]["stream"] is True
    assert t["text"] == final["output"][0]["content"][0]["text"]
    raw = httpx.post(fake_vllm.url + "/v1/responses", json={**RESPONSE, **RAW}).json()
    assert t["prompt_token_ids"] == raw["input_messages"][0]["tokens"]
    assert t["completion_token_ids"] == raw["output_messages"][0]["tokens"]
    assert len(t["logprobs"]) == len(t["completion_token_ids"])


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_is_recorded_as_a_tool_call_with_scored_logprobs(
    proxy: RunningProxy, fake_vllm: FakeVLLM, stream: bool
) -> None:
    body = {**RESPONSE, "input": "Please call a tool.", "tools": TOOLS, "stream": stream}
    r = proxy.client(**{"X-Episode-Id": f"tool-{stream}"}).post("/v1/responses", json=body)
    assert r.status_code == 200
    [t] = episode(proxy, f"tool-{stream}")
    [call] = t["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "Paris"}
    assert call["id"].startswith("chatcmpl-tool-")
    assert t["finish_reason"] == "tool_calls"
    # vLLM returns no logprobs for an output that is only a function call: the proxy asked the
    # same replica for them (prompt_logprobs), and got what was sampled.
    scoring = fake_vllm.requests[-1]
    assert scoring["path"] == "/v1/completions"
    assert scoring["body"]["prompt"] == t["prompt_token_ids"] + t["completion_token_ids"]
    sampled = fake_vllm.state.sampled[tuple(scoring["body"]["prompt"])]
    assert t["logprobs"] == pytest.approx(sampled, rel=1e-6)


def test_calls_not_sampled_from_the_raw_distribution_are_not_scored(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    body = {**RESPONSE, "input": "Please call a tool.", "tools": TOOLS, "temperature": 0.5}
    proxy.client(**{"X-Episode-Id": "hot"}).post("/v1/responses", json=body)
    [t] = episode(proxy, "hot")
    assert t["completion_token_ids"] and t["logprobs"] == []  # the trainer skips it
    assert [r["path"] for r in fake_vllm.requests] == ["/v1/responses"]


def test_a_tool_round_trip_records_each_turn_with_its_items(proxy: RunningProxy) -> None:
    client = proxy.client(**{"X-Episode-Id": "multi"})
    first = {**RESPONSE, "input": [{"role": "user", "content": "Please call a tool."}]}
    out = client.post("/v1/responses", json={**first, "tools": TOOLS}).json()["output"]
    result = {"type": "function_call_output", "call_id": out[0]["call_id"], "output": "7"}
    items = [*first["input"], out[0], result]
    second = client.post("/v1/responses", json={**RESPONSE, "input": items, "tools": TOOLS})
    assert second.status_code == 200
    turns = episode(proxy, "multi", 2)
    assert [len(t["messages"]) for t in turns] == [1, 3]
    assert turns[1]["messages"][2] == result
    assert turns[1]["messages"][1]["call_id"] == out[0]["call_id"]


def test_what_vllm_cannot_record_or_check_is_refused_before_anything_is_sent(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    r = proxy.client(**{"X-Episode-Id": "bg"}).post(
        "/v1/responses", json={**RESPONSE, "background": True}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "background" and "background" in error["message"]
    bad = proxy.client().post("/v1/responses", json={**RESPONSE, "include": "logprobs"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "include"
    # A tool result that answers no call in the input (vLLM would render it and answer 200).
    user = {"role": "user", "content": "hi"}
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    orphan = {"type": "function_call_output", "call_id": "call_2", "output": "7"}
    bad = proxy.client().post("/v1/responses", json={**RESPONSE, "input": [user, call, orphan]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[2].call_id"
    assert "'call_2'" in bad.json()["error"]["message"]
    early = {**orphan, "call_id": "call_1"}  # before its call
    bad = proxy.client().post("/v1/responses", json={**RESPONSE, "input": [user, early, call]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[1].call_id"
    assert fake_vllm.requests == []
    assert proxy.query("SELECT count(*) FROM transition") == [(0,)]


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"input": 5}, 400, "body.input"),
        ({"model": "nope"}, 404, "model"),
    ],
)
def test_vllm_errors_pass_through_and_are_recorded_failed(
    proxy: RunningProxy, fake_vllm: FakeVLLM, change: dict[str, Any], status: int, param: str
) -> None:
    body = {**RESPONSE, **change}
    r = proxy.client(**{"X-Episode-Id": "err"}).post("/v1/responses", json=body)
    direct = httpx.post(fake_vllm.url + "/v1/responses", json=body)
    assert (r.status_code, r.json()) == (status, direct.json())
    assert r.json()["error"]["param"] == param
    rows = proxy.wait_rows("SELECT status, http_status FROM transition", 1)
    assert rows == [("failed", status)]


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_previous_response_gets_a_404_that_says_why(
    proxy: RunningProxy, fake_vllm: FakeVLLM, stream: bool
) -> None:
    """vLLM's own 404 names `response_id` and not why; the proxy's names the setting."""
    body = {**RESPONSE, "previous_response_id": "resp_nope", "stream": stream}
    r = proxy.client(**{"X-Episode-Id": "prev"}).post("/v1/responses", json=body)
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["param"] == "previous_response_id" and error["code"] == "response_not_found"
    assert (
        "'resp_nope'" in error["message"] and "VLLM_ENABLE_RESPONSES_API_STORE" in error["message"]
    )
    rows = proxy.wait_rows("SELECT status, http_status, error FROM transition", 1)
    assert rows == [("failed", 404, r.json())]


@pytest.mark.slow
def test_client_disconnect_mid_stream_records_aborted(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    fake_vllm.token_delay_s = 0.2
    body = {**RESPONSE, "max_output_tokens": 50, "stream": True}
    with (
        proxy.client(**{"X-Episode-Id": "gone"}) as c,
        c.stream("POST", "/v1/responses", json=body) as r,
    ):
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break  # leave after the first token: closes the connection
    rows = proxy.wait_rows("SELECT status FROM transition WHERE episode_id = 'gone'", 1)
    assert rows == [("aborted",)]
