"""The Messages API's conversion, pure (proxy/relay/messages.py, messages_answer.py): what the
fake vLLM never sends (a matched stop string, reasoning, an error chunk mid-stream, a broken
tool call) turned into Anthropic's shapes as vLLM's own converter does."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.relay import messages, messages_answer
from proxy.relay.wire import CHAT, Choice, collect_chunk


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            name, data = block.split(b"\n")
            out.append((name.removeprefix(b"event: ").decode(), orjson.loads(data[6:])))
    return out


@pytest.mark.parametrize(
    ("finish", "matched", "tool", "expected"),
    [
        ("length", None, True, ("max_tokens", None)),
        ("stop", "\n\n", False, ("stop_sequence", "\n\n")),
        ("stop", 7, False, ("end_turn", None)),  # a stop token, not a sequence
        ("stop", None, True, ("tool_use", None)),  # a forced (named) call finishes with "stop"
        ("tool_calls", None, True, ("tool_use", None)),
        ("abort", None, False, (None, None)),
    ],
)
def test_stop_reasons(finish: str, matched: Any, tool: bool, expected: tuple[Any, Any]) -> None:
    got = messages_answer.stop_reason(finish, matched, tool_used=tool, tool_complete=tool)
    assert got == expected


def test_a_message_with_reasoning_a_broken_call_and_cached_tokens() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{nope"}}
    data = {
        "model": "demo",
        "choices": [
            {
                "message": {"content": "Hi", "reasoning": "think", "tool_calls": [call]},
                "finish_reason": "tool_calls",
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }
    message = messages_answer.message("0000-11", data)
    assert message["id"] == "msg_000011"
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][2]["input"] == {}  # the record keeps what the model wrote
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4}
    empty = messages_answer.message(
        "1", {"choices": [{"message": {"content": None}, "finish_reason": "stop"}]}
    )
    assert empty["content"] == [{"type": "text", "text": ""}] and empty["stop_reason"] == "end_turn"


def stream_of(chunks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    collected: dict[int, Choice] = {}
    stream = messages_answer.Stream("r", collected.setdefault(0, Choice()))
    out = b""
    for chunk in chunks:
        collect_chunk(CHAT, chunk, collected)
        out += stream.event(chunk)
    return events(out + stream.end())


def delta(**fields: Any) -> dict[str, Any]:
    return {"model": "demo", "choices": [{"index": 0, "delta": fields, "token_ids": [1]}]}


def test_a_stream_of_reasoning_text_and_a_tool_call_ending_on_a_stop_string() -> None:
    name = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}
    chunks = [
        {
            "model": "demo",
            "prompt_token_ids": [5, 6],
            "choices": [{"index": 0, "delta": {"role": "assistant"}}],
        },
        delta(reasoning="hm"),
        delta(content="A"),
        delta(content="B"),
        delta(tool_calls=[name]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '{"x": '}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": "1"}}]),
        {
            "model": "demo",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "}"}],
        },
    ]
    got = stream_of(chunks)
    names = [n for n, _ in got]
    assert names == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # fmt: skip
    assert got[0][1]["message"]["usage"] == {"input_tokens": 2, "output_tokens": 0}
    assert got[3][1]["delta"]["type"] == "signature_delta"  # a thinking block is signed
    assert [e["index"] for n, e in got if n == "content_block_start"] == [0, 1, 2]
    assert got[9][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert got[11][1]["delta"] == {"type": "input_json_delta", "partial_json": "1"}
    # the stop string cut the call short ('{"x": 1' is not JSON): a stop sequence, as vLLM says
    assert got[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "}"}
    assert got[-2][1]["usage"] == {"input_tokens": 2, "output_tokens": 6}  # six token ids


def test_an_error_chunk_is_an_error_event_and_the_stream_ends_there() -> None:
    chunks = [delta(content="A"), {"error": {"message": "engine died", "code": 500}}]
    got = stream_of(chunks)
    assert [n for n, _ in got][-1] == "error"
    assert got[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "engine died"}}


def test_vllm_s_error_body_is_re_said() -> None:
    body = orjson.dumps({"error": {"message": "too long", "type": "BadRequestError"}})
    assert orjson.loads(messages_answer.error_body(400, body)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "too long"},
    }
    assert b"overloaded_error" in messages_answer.error_body(503, b"<html>busy</html>")


def test_the_conversion_of_every_block_kind() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 5,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: 1"},
            {"type": "text", "text": "S"},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "url", "url": "http://i"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "tool_use", "id": "u1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "u1",
                        "content": [
                            {"type": "text", "text": "r1"},
                            {"type": "text", "text": "r2"},
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA",
                                },
                            },
                        ],
                    }
                ],
            },
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "thinking": {"type": "enabled", "budget_tokens": 9},
        "top_k": 3,
    }
    messages.check(body)
    chat = messages.chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://i"}}]},
        {
            "role": "assistant",
            "reasoning": "t",
            "tool_calls": [
                {"id": "u1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "u1", "content": "r1\nr2"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}],
        },
    ]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert (chat["thinking_token_budget"], chat["top_k"], chat["max_completion_tokens"]) == (
        9,
        3,
        5,
    )
    named = messages.chat_request({**body, "tool_choice": {"type": "tool", "name": "f"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
