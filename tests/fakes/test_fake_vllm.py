"""Keep fakes/vllm.py honest: replay every captured real vLLM request against the fake and
compare status, framing and the structure of the answer (keys, null versus present, value types).

Values (text, token ids, logprobs, ids, timestamps) differ by design; structure must not.
"""

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakes.vllm import FakeVLLM

WIRE = Path(__file__).parents[1] / "data" / "vllm_wire"
LORA_SEQUENCE = [  # order matters: each step depends on the adapters the previous ones loaded
    "lora_load",
    "lora_load_duplicate",
    "lora_load_bad_path",
    "models_with_lora",
    "chat_lora",
    "lora_unload",
    "lora_unload_unknown",
]
# The fake tokenises differently, so this prompt must be longer to overflow its context too; and
# the real model was forced into a tool call by a regex, which the fake does on "call a tool".
CALL = {"messages": [{"role": "user", "content": "Please call a tool."}]}
REQUEST_OVERRIDES: dict[str, dict[str, Any]] = {
    "error_prompt_too_long": {"prompt": "What is 3 + 4? " * 120},
    "chat_tools_auto_parsed": CALL,
    "chat_stream_tools_auto_parsed": CALL,
    "responses_stop": {"max_output_tokens": 64},  # the fake's texts are longer than "7"
    "responses_tools_auto_parsed": {"input": "Please call a tool."},
    "responses_stream_tools_auto_parsed": {"input": "Please call a tool."},
}
CASES = sorted(p.stem for p in WIRE.glob("*.json") if p.stem not in LORA_SEQUENCE)


def shape(value: Any, key: str = "") -> Any:
    """The structure of a JSON value: dict keys, list element shapes, and value types."""
    if key == "delta":  # which delta keys appear depends on the sampled text; checked separately
        return "delta"
    if key == "bytes":  # [] for a token that ends inside a UTF-8 character
        return "bytes"
    if key == "stop_reason":  # null, or the id of the stop token when it was not the main EOS
        return "stop_reason"
    if key == "top_logprobs" and isinstance(value, dict):  # completions: token text -> logprob
        return "map"
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        shapes = []
        for item in value:
            if (s := shape(item, key)) not in shapes:
                shapes.append(s)
        return ["list", *shapes]
    if value is None:
        return "null"
    return {bool: "bool", int: "number", float: "number", str: "str"}[type(value)]


def sse_events(raw: str) -> list[Any]:
    """Check vLLM's framing and return the chunks: chat and completions send `data: {json}\\n\\n`
    ... `data: [DONE]\\n\\n`; the Responses API `event: <type>\\ndata: {json}\\n\\n`, no [DONE]."""
    events = raw.split("\n\n")
    assert events.pop() == ""
    if events[0].startswith("event: "):
        chunks = []
        for event in events:
            name, data = event.split("\n")
            chunks.append(json.loads(data.removeprefix("data: ")))
            assert name == f"event: {chunks[-1]['type']}"
        return chunks
    assert events.pop() == "data: [DONE]"
    assert all(event.startswith("data: ") for event in events)
    return [json.loads(event.removeprefix("data: ")) for event in events]


def dedupe(chunks: list[Any]) -> list[Any]:
    """Consecutive events of one type as one (the number of deltas depends on the text)."""
    return [c for i, c in enumerate(chunks) if i == 0 or c["type"] != chunks[i - 1]["type"]]


def mask(message: str) -> str:
    """Error messages carry numbers and temporary paths that differ between runs."""
    return re.sub(r"\d+", "N", re.sub(r"/\S+|<path>", "PATH", message))


def replay(
    client: httpx.Client, name: str, lora_dir: Path
) -> tuple[dict[str, Any], httpx.Response]:
    real = json.loads((WIRE / f"{name}.json").read_text())
    request = real["request"]
    body = request["body"]
    if body is not None:
        body = {**body, **REQUEST_OVERRIDES.get(name, {})}
        if name in ("lora_load", "lora_load_duplicate"):
            body["lora_path"] = str(lora_dir)
    response = client.request(request["method"], request["path"], json=body)
    return real, response


def assert_same_structure(real: dict[str, Any], response: httpx.Response) -> None:
    assert response.status_code == real["status"]
    media_type = response.headers.get("content-type", "").split(";")[0]
    if "sse" in real:
        assert media_type == "text/event-stream"
        real_chunks, fake_chunks = sse_events(real["sse"]), sse_events(response.text)
        assert {json.dumps(shape(c)) for c in fake_chunks} == {
            json.dumps(shape(c)) for c in real_chunks
        }
        if "choices" in real_chunks[0]:
            real_deltas = {
                tuple(sorted(c.get("delta", ()))) for r in real_chunks for c in r["choices"]
            }
            fake_deltas = {
                tuple(sorted(c.get("delta", ()))) for f in fake_chunks for c in f["choices"]
            }
            assert fake_deltas <= real_deltas | {()}  # () is the end-of-sequence token's delta
        else:  # the Responses API: the same event types in the same order
            assert [c["type"] for c in dedupe(fake_chunks)] == [
                c["type"] for c in dedupe(real_chunks)
            ]
    elif "text" in real:
        assert response.text == real["text"]
    else:
        assert media_type == "application/json"
        fake_body, real_body = response.json(), real["body"]
        assert shape(fake_body) == shape(real_body)
        if "choices" in real_body:
            assert len(fake_body["choices"]) == len(real_body["choices"])
        if "error" in real_body:
            fake_error, real_error = fake_body["error"], real_body["error"]
            assert mask(fake_error.pop("message")) == mask(real_error.pop("message"))
            assert fake_error == real_error


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeVLLM]:
    with FakeVLLM() as server:
        yield server


@pytest.mark.parametrize("name", CASES)
def test_fake_matches_captured_vllm(fake: FakeVLLM, name: str, tmp_path: Path) -> None:
    with httpx.Client(base_url=fake.url, timeout=10) as client:
        real, response = replay(client, name, tmp_path)
    assert_same_structure(real, response)


def test_lora_lifecycle_matches_captured_vllm(tmp_path: Path) -> None:
    with FakeVLLM() as server, httpx.Client(base_url=server.url, timeout=10) as client:
        for name in LORA_SEQUENCE:
            real, response = replay(client, name, tmp_path)
            assert_same_structure(real, response)  # `pytest -l` shows which `name` failed


def test_knobs_record_requests_and_inject_failures() -> None:
    body = {"model": "demo", "prompt": "What is 3 + 4?", "max_tokens": 3}
    with FakeVLLM() as server, httpx.Client(base_url=server.url, timeout=10) as client:
        server.fail_next(1, status=503)
        assert client.post("/v1/completions", json=body).status_code == 503
        first = client.post("/v1/completions", json=body).json()
        again = client.post("/v1/completions", json=body).json()
        assert first["choices"][0]["text"] == again["choices"][0]["text"]  # deterministic
        assert [r["body"] for r in server.requests] == [body, body, body]


def test_max_running_queues_generations_beyond_the_batch() -> None:
    """vLLM's --max-num-seqs: with a batch of 2, four 0.3 s calls at once take two turns."""
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
    with FakeVLLM(latency_s=0.3, max_running=2) as server:

        async def four() -> float:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                started = time.perf_counter()
                calls = [client.post("/v1/completions", json=body) for _ in range(4)]
                answers = await asyncio.gather(*calls)
                assert all(a.status_code == 200 for a in answers)
                return time.perf_counter() - started

        took = asyncio.run(four())
        assert took >= 0.6, took  # two turns of 0.3 s (unlimited: one)


def test_tool_call_when_asked() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
    body = {
        "model": "demo",
        "tools": [tool],
        "messages": [{"role": "user", "content": "Please call a tool."}],
    }
    with FakeVLLM() as server, httpx.Client(base_url=server.url, timeout=10) as client:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "add", "arguments": '{"a": 3}'}


def test_always_detail_sends_ids_and_logprobs_unasked() -> None:
    """The benchmarks' fake: a direct caller gets the same-size answer the proxy asks for."""
    body = {"model": "demo", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    with FakeVLLM() as lean, FakeVLLM(always_detail=True) as detailed:
        plain = httpx.post(lean.url + "/v1/chat/completions", json=body).json()
        full = httpx.post(detailed.url + "/v1/chat/completions", json=body).json()
        asked = {**body, "logprobs": True, "return_token_ids": True}
        reference = httpx.post(lean.url + "/v1/chat/completions", json=asked).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["logprobs"] is None
    assert full["prompt_token_ids"] == reference["prompt_token_ids"]
    assert full["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert full["choices"][0]["logprobs"] == reference["choices"][0]["logprobs"]
