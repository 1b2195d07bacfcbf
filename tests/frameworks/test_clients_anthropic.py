"""Anthropic's Python SDK against the proxy's Messages route (`POST /v1/messages`), the fake vLLM
behind it: the SDK gets Anthropic's shapes, vLLM gets a chat call (with token ids and logprobs
asked for), and the proxy records it as it records a chat call, the Anthropic request kept.

As in tests/frameworks/test_clients.py, each test checks both sides: what the SDK handed back, and
the
transitions stored (tags, token ids, logprobs, text, tool calls). The fake vLLM calls a tool when
a request has tools and the last user message says "call a tool" (or a tool is forced).
"""

from __future__ import annotations

import json
from typing import Any

from anthropic import Anthropic, AsyncAnthropic

from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy
from tests.frameworks.test_clients import assert_complete, recorded, tag_headers

WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK_WEATHER: Any = {"role": "user", "content": "Please call a tool for the weather in Paris."}


def client(proxy: RunningProxy, episode: str) -> Anthropic:
    return Anthropic(base_url=proxy.url, api_key="x", default_headers=tag_headers(episode))


def chat_sent(fake: FakeVLLM) -> dict[str, Any]:
    """The last chat request the fake vLLM was sent."""
    [*_, sent] = [r for r in fake.requests if r["path"] == "/v1/chat/completions"]
    body: dict[str, Any] = sent["body"]
    return body


def test_create_with_a_system_prompt(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    raw = client(proxy, "an-create").messages.with_raw_response.create(
        model="demo",
        system="You add numbers.",
        messages=[{"role": "user", "content": "What is 3 + 4?"}],
        max_tokens=6,
        extra_body={"temperature": 0.5},  # not among this SDK's arguments; vLLM's still
        metadata={"user_id": "u1"},
    )
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert raw.headers["x-episode-id"] == "an-create"

    sent = chat_sent(fake_vllm)  # the chat call the conversion made
    assert sent["messages"] == [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    assert (sent["max_tokens"], sent["temperature"]) == (6, 0.5)
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert "metadata" not in sent

    [t] = recorded(proxy, "an-create", 1)
    assert_complete(t)
    assert t["route"] == "messages"
    assert t["id"] == raw.headers["x-transition-id"]
    assert t["text"] == block.text
    assert t["messages"] == [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    assert t["params"]["metadata"] == {"user_id": "u1"} and "system" not in t["params"]
    assert message.usage.input_tokens == len(t["prompt_token_ids"])
    assert message.usage.output_tokens == len(t["completion_token_ids"])


async def test_async_create_with_system_blocks_and_many_turns(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    turns: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "Hi."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
    ]
    system: Any = [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}]
    async with AsyncAnthropic(
        base_url=proxy.url, api_key="x", default_headers=tag_headers("an-turns")
    ) as anthropic:
        message = await anthropic.messages.create(
            model="demo", system=system, messages=turns, max_tokens=5, stop_sequences=["\n\n"]
        )
    sent = chat_sent(fake_vllm)
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief. Be kind."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
    ]
    assert sent["stop"] == ["\n\n"]
    [t] = recorded(proxy, "an-turns", 1)
    assert_complete(t)
    assert t["messages"] == [{"role": "system", "content": system}, *turns]
    assert t["text"] == message.content[0].text  # type: ignore[union-attr]


def test_stream_text_and_usage_match_the_record(proxy: RunningProxy) -> None:
    base_url = f"{proxy.url}/episode/an-stream/task/T7/agent/planner"  # tags by path
    anthropic = Anthropic(base_url=base_url, api_key="x")
    with anthropic.messages.stream(
        model="demo", messages=[{"role": "user", "content": "Count."}], max_tokens=8
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason in ("end_turn", "max_tokens")

    [t] = recorded(proxy, "an-stream", 1)
    assert_complete(t, task="T7", agent="planner")
    assert t["route"] == "messages"
    assert t["text"] == text
    assert final.usage.output_tokens == len(t["completion_token_ids"]) == 8
    assert final.usage.input_tokens == len(t["prompt_token_ids"])


def test_a_tool_round_trip(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    anthropic = client(proxy, "an-tools")
    first = anthropic.messages.create(
        model="demo", messages=[ASK_WEATHER], tools=[WEATHER], max_tokens=64
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    sent = chat_sent(fake_vllm)
    assert sent["tool_choice"] == "auto"
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "The weather in a city.",
            },
        }
    ]

    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}
    turns: list[Any] = [
        ASK_WEATHER,
        {"role": "assistant", "content": first.model_dump()["content"]},
        {"role": "user", "content": [result]},
    ]
    second = anthropic.messages.create(model="demo", messages=turns, tools=[WEATHER], max_tokens=6)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content[0].type == "text"
    # the assistant's tool call and the tool's result, as vLLM's own conversion sends them
    assert chat_sent(fake_vllm)["messages"][1:] == [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C."},
    ]

    calling, answering = recorded(proxy, "an-tools", 2)
    assert_complete(calling)
    assert calling["finish_reason"] == "tool_calls"
    [stored] = calling["tool_calls"]
    assert stored["id"] == use.id
    assert json.loads(stored["function"]["arguments"]) == use.input
    assert calling["tool_errors"] is None
    assert_complete(answering)
    assert answering["messages"][-1] == {"role": "user", "content": [result]}
    assert answering["tool_calls"] is None


def test_a_streamed_tool_call(proxy: RunningProxy) -> None:
    with client(proxy, "an-tools-sse").messages.stream(
        model="demo",
        messages=[{"role": "user", "content": "What is the weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=64,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use"  # forced: vLLM finishes with "stop", still a tool use

    [t] = recorded(proxy, "an-tools-sse", 1)
    assert_complete(t)
    [stored] = t["tool_calls"]
    assert stored["id"] == use.id and stored["function"]["name"] == "get_weather"
    assert json.loads(stored["function"]["arguments"]) == {"city": "Paris"}
