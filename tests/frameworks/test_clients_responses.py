"""Today's clients on the Responses API, and LangGraph's ReAct agent, through the proxy (fake
vLLM; tests/e2e/test_e2e_clients.py runs the same kinds of calls against the real one).

The fake calls a tool when the input says "call a tool" and does not end with a tool's result, or
when `tool_choice` forces one; otherwise it answers with text.
"""

from __future__ import annotations

import json
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from openai import AsyncOpenAI, OpenAI

from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy
from tests.frameworks.test_clients import assert_complete, recorded, tag_headers
from tests.proxy.relay.test_responses import CALCULATOR


def test_openai_responses_create_with_raw_response_headers(proxy: RunningProxy) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-resp"))
    raw = client.responses.with_raw_response.create(
        model="demo", input="What is 3 + 4?", instructions="Be brief.", max_output_tokens=6
    )
    response = raw.parse()
    assert response.output_text

    [t] = recorded(proxy, "oa-resp", 1)
    assert t["id"] == raw.headers["x-transition-id"]
    assert_complete(t)
    assert t["route"] == "responses" and t["text"] == response.output_text
    assert t["messages"][0] == {"role": "system", "content": "Be brief."}


async def test_openai_async_responses_stream(proxy: RunningProxy) -> None:
    client = AsyncOpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-rs"))
    async with client:
        stream = await client.responses.create(
            model="demo", input="What is 3 + 4?", max_output_tokens=8, stream=True
        )
        deltas, final = [], None
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                final = event.response
    assert final is not None and "".join(deltas) == final.output_text

    [t] = recorded(proxy, "oa-rs", 1)
    assert_complete(t)
    assert t["text"] == final.output_text
    assert t["usage"]["completion_tokens"] == final.usage.output_tokens  # type: ignore[union-attr]


def test_openai_responses_tool_round_trip(proxy: RunningProxy) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="x", default_headers=tag_headers("oa-tool"))
    items: list[Any] = [{"role": "user", "content": "Please call a tool: what is 3 + 4?"}]
    first = client.responses.create(model="demo", input=items, tools=[CALCULATOR])
    [call] = [item for item in first.output if item.type == "function_call"]
    items += [call.model_dump(exclude_none=True)]
    items += [{"type": "function_call_output", "call_id": call.call_id, "output": "7"}]
    second = client.responses.create(model="demo", input=items, tools=[CALCULATOR])
    assert second.output_text

    one, two = recorded(proxy, "oa-tool", 2)
    for t in (one, two):
        assert_complete(t)  # the function call's logprobs were scored by the proxy
    [stored] = one["tool_calls"]
    assert stored["id"] == call.call_id and stored["function"]["name"] == "calculator"
    assert two["messages"][-1] == items[-1] and two["text"] == second.output_text


# --- OpenAI Agents SDK, with its default model: the Responses API ------------------------------


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return str(eval(expression, {"__builtins__": {}}))  # a test tool: digits and operators only


async def test_openai_agents_default_responses_model_with_a_tool(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    """The user's code unchanged: the SDK's default client pointed at the proxy, `model` a name."""
    set_tracing_disabled(True)
    client = AsyncOpenAI(
        base_url=proxy.v1, api_key="x", default_headers=tag_headers("ag-resp", agent="calc")
    )
    set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(
        name="calc",
        instructions="Use the calculator.",
        model="demo",
        model_settings=ModelSettings(tool_choice="required", max_tokens=16),
        tools=[calculator],
    )
    async with client:
        result = await Runner.run(agent, "What is 3 + 4?", max_turns=3)
    assert isinstance(result.final_output, str) and result.final_output
    paths = {r["path"] for r in fake_vllm.requests}
    assert paths == {"/v1/responses", "/v1/completions"}  # the calls, and the proxy's scoring

    first, second = recorded(proxy, "ag-resp", 2)
    for t in (first, second):
        assert_complete(t, agent="calc")
        assert t["route"] == "responses"
    [stored] = first["tool_calls"]
    assert stored["function"]["name"] == "calculator"
    outputs = [m for m in second["messages"] if m.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [stored["id"]]
    assert second["text"] == result.final_output


# --- LangChain and LangGraph -----------------------------------------------------------------


def test_langchain_responses_api_mode(proxy: RunningProxy) -> None:
    model = ChatOpenAI(
        base_url=proxy.v1,
        api_key="x",
        model="demo",
        max_tokens=6,
        default_headers=tag_headers("lc-resp", agent="lc"),
        use_responses_api=True,
    )
    message = model.invoke("What is 3 + 4?")
    assert message.text

    [t] = recorded(proxy, "lc-resp", 1)
    assert_complete(t, agent="lc")
    assert t["route"] == "responses" and t["text"] == message.text


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_langgraph_react_agent_with_a_tool(proxy: RunningProxy) -> None:
    model = ChatOpenAI(
        base_url=proxy.v1,
        api_key="x",
        model="demo",
        max_tokens=16,
        default_headers=tag_headers("lg-react", agent="react"),
    )
    graph = create_react_agent(model, [add])
    state = graph.invoke({"messages": [("user", "Please call a tool: add 3 and 4.")]})
    tool_results = [m for m in state["messages"] if m.type == "tool"]
    assert [m.content for m in tool_results] == ["6"]  # the fake's arguments: a=3, b=3

    first, second = recorded(proxy, "lg-react", 2)
    for t in (first, second):
        assert_complete(t, agent="react")
    [stored] = first["tool_calls"]
    assert json.loads(stored["function"]["arguments"]) == {"a": 3, "b": 3}
    assert second["messages"][-1]["role"] == "tool"
    assert second["text"] == state["messages"][-1].content
