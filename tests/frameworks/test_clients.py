"""Real client libraries against a running proxy: each gets what it expects; the proxy records it.

Every test uses its own episode id and checks both sides: what the client library handed back,
and the transitions the proxy stored (tags, status, token ids, logprobs, text, tool calls).
The fake vLLM returns a tool call when a request has `tools` and either `tool_choice` forces one
or the last user message says "call a tool"; otherwise it answers with text.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from autogen_core.models import UserMessage
from autogen_ext.models.openai import OpenAIChatCompletionClient
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI, OpenAI

from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy

MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def tag_headers(episode: str, task: str = "t1", agent: str = "solver") -> dict[str, str]:
    return {"X-Episode-Id": episode, "X-Task-Id": task, "X-Agent-Name": agent}


def recorded(proxy: RunningProxy, episode: str, expected: int) -> list[dict[str, Any]]:
    """The episode's transitions with token ids, once the asynchronous writer has stored them."""
    rows = proxy.wait_rows("SELECT id FROM transition WHERE episode_id = %s", expected, episode)
    assert len(rows) == expected, f"{len(rows)} transitions stored, expected {expected}"
    with proxy.client() as c:
        r = c.get(f"/v1/episodes/{episode}", params={"tokens": "true"})
    assert r.status_code == 200, r.text
    transitions: list[dict[str, Any]] = r.json()["transitions"]
    return transitions


def assert_complete(t: dict[str, Any], task: str = "t1", agent: str = "solver") -> None:
    """A successful transition with its tags and the token-level data the trainer needs."""
    assert t["status"] == "ok", t
    assert (t["task_id"], t["agent_name"]) == (task, agent)
    assert t["prompt_token_ids"]
    assert t["completion_token_ids"]
    assert len(t["logprobs"]) == len(t["completion_token_ids"])


# --- openai-python ---------------------------------------------------------------------------


def test_openai_sync_chat_with_raw_response_headers(proxy: RunningProxy) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-sync"))
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=5
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.choices[0].logprobs is None  # not asked for: stripped again
    assert raw.headers["x-episode-id"] == "oa-sync"
    assert raw.headers["x-policy-version"] == "none"

    [t] = recorded(proxy, "oa-sync", 1)
    assert_complete(t)
    assert t["id"] == raw.headers["x-transition-id"]
    assert t["text"] == completion.choices[0].message.content
    assert t["messages"] == MESSAGES
    assert len(t["completion_token_ids"]) == completion.usage.completion_tokens == 5


async def test_openai_async_chat(proxy: RunningProxy) -> None:
    client = AsyncOpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-async"))
    async with client:
        completion = await client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=6
        )
    [t] = recorded(proxy, "oa-async", 1)
    assert_complete(t)
    assert t["text"] == completion.choices[0].message.content
    assert len(t["completion_token_ids"]) == 6


def test_openai_streaming_text_and_usage_match_the_record(proxy: RunningProxy) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-stream"))
    stream = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 8

    [t] = recorded(proxy, "oa-stream", 1)
    assert_complete(t)
    assert t["text"] == text
    assert len(t["completion_token_ids"]) == 8
    assert t["usage"] == {"prompt_tokens": usage.prompt_tokens, "completion_tokens": 8}


def test_openai_path_form_base_url_carries_the_tags(proxy: RunningProxy) -> None:
    client = OpenAI(base_url=f"{proxy.url}/episode/oa-path/task/T7/agent/planner/v1", api_key="x")
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=4
    )
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-episode-id"] == "oa-path"

    [t] = recorded(proxy, "oa-path", 1)
    assert_complete(t, task="T7", agent="planner")
    assert t["id"] == raw.headers["x-transition-id"]


def test_openai_n_choices_and_logprobs(proxy: RunningProxy) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-n"))
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=5, n=2, logprobs=True, top_logprobs=2
    )
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.logprobs is not None and len(choice.logprobs.content) == 5
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)

    transitions = recorded(proxy, "oa-n", 2)
    assert [t["choice_index"] for t in transitions] == [0, 1]
    assert [t["id"] for t in transitions] == raw.headers["x-transition-id"].split(",")
    for t, choice in zip(transitions, completion.choices, strict=True):
        assert_complete(t)
        assert t["text"] == choice.message.content
        client_logprobs = [entry.logprob for entry in choice.logprobs.content]
        assert t["logprobs"] == pytest.approx(client_logprobs, rel=1e-6)


def test_openai_tool_call_is_returned_and_recorded(proxy: RunningProxy) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-tools"))
    completion = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Please call a tool for the weather."}],
        tools=[WEATHER_TOOL],
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    [t] = recorded(proxy, "oa-tools", 1)
    assert_complete(t)
    assert t["finish_reason"] == "tool_calls"
    [stored] = t["tool_calls"]
    assert stored["id"] == call.id
    assert stored["function"] == {"name": "get_weather", "arguments": call.function.arguments}


def test_openai_streamed_tool_call_is_reassembled_in_the_record(proxy: RunningProxy) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-tools-sse"))
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Please call a tool for the weather."}],
        tools=[WEATHER_TOOL],
        stream=True,
    )
    deltas = [d for ch in stream for d in ch.choices[0].delta.tool_calls or ()]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert json.loads(arguments) == {"city": "Paris"}

    [t] = recorded(proxy, "oa-tools-sse", 1)
    assert_complete(t)
    assert t["finish_reason"] == "tool_calls"
    assert t["tool_calls"] == [
        {
            "id": deltas[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }
    ]


def test_openai_models_list_and_policy_alias(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-policy"))
    names = [m.id for m in client.models.list()]
    assert "demo" in names and "policy" in names

    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=MESSAGES, max_tokens=3
    )
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-policy-version"] == "0"
    assert fake_vllm.requests[-1]["body"]["model"] == "demo"

    [t] = recorded(proxy, "oa-policy", 1)
    assert_complete(t)
    assert (t["model_requested"], t["model_used"], t["policy_version"]) == ("policy", "demo", 0)


# --- LangChain -------------------------------------------------------------------------------


def langchain_model(proxy: RunningProxy, episode: str) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=proxy.v1,
        api_key="x",
        model="demo",
        max_tokens=6,
        default_headers=tag_headers(episode, agent="lc"),
        use_responses_api=False,
    )


def test_langchain_invoke(proxy: RunningProxy) -> None:
    message = langchain_model(proxy, "lc-invoke").invoke("What is 3 + 4?")
    assert isinstance(message.content, str) and message.content

    [t] = recorded(proxy, "lc-invoke", 1)
    assert_complete(t, agent="lc")
    assert t["text"] == message.content
    assert t["messages"] == MESSAGES


def test_langchain_stream(proxy: RunningProxy) -> None:
    chunks = list(langchain_model(proxy, "lc-stream").stream("What is 3 + 4?"))
    assert all(isinstance(ch, AIMessageChunk) for ch in chunks)
    text = "".join(str(ch.content) for ch in chunks)
    assert text

    [t] = recorded(proxy, "lc-stream", 1)
    assert_complete(t, agent="lc")
    assert t["text"] == text


def test_langchain_bind_tools(proxy: RunningProxy) -> None:
    model = langchain_model(proxy, "lc-tools").bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    message = model.invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})

    [t] = recorded(proxy, "lc-tools", 1)
    assert_complete(t, agent="lc")
    [stored] = t["tool_calls"]
    assert stored["id"] == call["id"]
    assert stored["function"]["name"] == "get_weather"


# --- OpenAI Agents SDK -----------------------------------------------------------------------


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}."


async def test_openai_agents_runner_with_a_tool(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    """Turn 1 is forced to call the tool; the SDK then resets tool_choice and turn 2 answers."""
    set_tracing_disabled(True)
    client = AsyncOpenAI(
        base_url=proxy.v1, api_key="x", default_headers=tag_headers("ag-run", agent="weather")
    )
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        model=OpenAIChatCompletionsModel(model="demo", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=8),
        tools=[get_weather],
    )
    async with client:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    assert isinstance(result.final_output, str) and result.final_output
    sent = [r["body"] for r in fake_vllm.requests if r["path"] == "/v1/chat/completions"]
    assert [body.get("tool_choice") for body in sent] == ["required", None]

    first, second = recorded(proxy, "ag-run", 2)
    for t in (first, second):
        assert_complete(t, agent="weather")
    [stored] = first["tool_calls"]
    assert stored["function"]["name"] == "get_weather"
    assert json.loads(stored["function"]["arguments"]) == {"city": "Paris"}
    # The second call carries the tool's result back, and its text is the run's answer.
    assert {"role": "tool", "tool_call_id": stored["id"], "content": "Sunny in Paris."} in [
        {k: m.get(k) for k in ("role", "tool_call_id", "content")} for m in second["messages"]
    ]
    assert second["tool_calls"] is None
    assert second["text"] == result.final_output


# --- AutoGen ---------------------------------------------------------------------------------


# What AutoGen must be told of a model it does not know (vLLM's served names).
AUTOGEN_MODEL_INFO: Any = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
}


async def test_autogen_openai_chat_completion_client(proxy: RunningProxy) -> None:
    client = OpenAIChatCompletionClient(
        model="demo",
        base_url=proxy.v1,
        api_key="x",
        max_tokens=7,
        model_info=AUTOGEN_MODEL_INFO,
        default_headers=tag_headers("autogen", agent="assistant"),
    )
    try:
        result = await client.create([UserMessage(content="What is 3 + 4?", source="user")])
    finally:
        await client.close()
    assert isinstance(result.content, str) and result.content
    assert result.usage.completion_tokens == 7

    [t] = recorded(proxy, "autogen", 1)
    assert_complete(t, agent="assistant")
    assert t["text"] == result.content
    assert len(t["completion_token_ids"]) == 7
