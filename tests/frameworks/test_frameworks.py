"""More agent frameworks against a running proxy on the fake vLLM, each unchanged but for its base
URL (and the tag headers, where it takes headers): Pydantic AI and smolagents here, in this venv;
DSPy, CrewAI and LlamaIndex (they need litellm or openai<3) in the frameworks venv and the `openai`
npm package in Node, each as a script of tests/clients/ run as a child (tests/client_runs.py).

As tests/frameworks/test_clients.py, each checks what the framework handed back and what the proxy
stored:
tags, status, token ids, logprobs, text, tool calls.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from fakes.vllm import FakeVLLM
from tests import client_runs
from tests.conftest import RunningProxy
from tests.frameworks.test_clients import MESSAGES, assert_complete, recorded, tag_headers

CALL_A_TOOL = "Please call a tool for the weather in Paris."


def chat_bodies(fake: FakeVLLM) -> list[dict[str, Any]]:
    return [r["body"] for r in fake.requests if r["path"] == "/v1/chat/completions"]


# --- Pydantic AI -----------------------------------------------------------------------------


def pydantic_agent(proxy: RunningProxy, episode: str) -> Agent[None, str]:
    model = OpenAIChatModel("demo", provider=OpenAIProvider(base_url=proxy.v1, api_key="x"))
    agent = Agent(
        model,
        instructions="Answer questions about the weather.",
        model_settings={"max_tokens": 8, "extra_headers": tag_headers(episode, agent="pyd")},
    )

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}."

    return agent


def test_pydantic_ai_agent_with_a_tool(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    """The fake calls the tool (asked to); Pydantic AI runs it and sends the result back."""
    result = pydantic_agent(proxy, "pyd-run").run_sync(CALL_A_TOOL)
    assert isinstance(result.output, str) and result.output
    assert [len(body.get("tools", [])) for body in chat_bodies(fake_vllm)] == [1, 1]

    first, second = recorded(proxy, "pyd-run", 2)
    for t in (first, second):
        assert_complete(t, agent="pyd")
    [stored] = first["tool_calls"]
    assert stored["function"]["name"] == "get_weather"
    assert json.loads(stored["function"]["arguments"]) == {"city": "Paris"}
    assert {"role": "tool", "tool_call_id": stored["id"], "content": "Sunny in Paris."} in [
        {k: m.get(k) for k in ("role", "tool_call_id", "content")} for m in second["messages"]
    ]
    assert second["text"] == result.output
    both = len(first["completion_token_ids"]) + len(second["completion_token_ids"])
    assert result.usage.output_tokens == both


async def test_pydantic_ai_streamed_text(proxy: RunningProxy) -> None:
    agent = pydantic_agent(proxy, "pyd-stream")
    async with agent.run_stream("What is 3 + 4?") as run:
        text = await run.get_output()
    assert text

    [t] = recorded(proxy, "pyd-stream", 1)
    assert_complete(t, agent="pyd")
    assert t["text"] == text
    assert t["messages"][-1] == MESSAGES[-1]


# --- smolagents ------------------------------------------------------------------------------


def smolagents_model(base_url: str, episode: str, **kwargs: Any) -> OpenAIServerModel:
    return OpenAIServerModel(
        "demo",
        api_base=base_url,
        api_key="x",
        client_kwargs={"default_headers": tag_headers(episode, agent="smol")},
        **kwargs,
    )


def test_smolagents_tool_calling_agent(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    """smolagents requires a tool call each step: step 1 calls get_weather, which runs; with
    max_steps=1 it then asks the model (no tools) for its final answer."""
    cities: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name.
        """
        cities.append(city)
        return f"Sunny in {city}."

    model = smolagents_model(proxy.v1, "smol-run", max_tokens=8)
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=1, verbosity_level=0)
    answer = agent.run("What is the weather in Paris?")
    assert cities == ["Paris"]
    sent = chat_bodies(fake_vllm)
    assert [body.get("tool_choice") for body in sent] == ["required", None]

    first, second = recorded(proxy, "smol-run", 2)
    for t in (first, second):
        assert_complete(t, agent="smol")
    [stored] = first["tool_calls"]
    assert stored["function"]["name"] == "get_weather"
    assert json.loads(stored["function"]["arguments"]) == {"city": "Paris"}
    # The tool's observation went back in the next prompt; that call's text is the answer.
    assert "Sunny in Paris." in json.dumps(second["messages"])
    assert second["text"] == str(answer)


# --- the frameworks venv's clients and Node's (tests/clients/) -------------------------------


def config(proxy: RunningProxy, episode: str, agent: str, **more: Any) -> dict[str, Any]:
    return {"base_url": proxy.v1, "headers": tag_headers(episode, agent=agent), **more}


ANSWER_FIELDS = "[[ ## answer ## ]]\n7\n\n[[ ## completed ## ]]"  # DSPy's ChatAdapter format


@pytest.mark.models("frameworks-venv")
def test_dspy_predict(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    """Through litellm's OpenAI provider: the proxy asks vLLM for the token ids itself."""
    fake_vllm.replies = [ANSWER_FIELDS]
    out = client_runs.python_client("dspy_predict.py", config(proxy, "dspy", "dspy"))
    assert out == {"answer": "7", "history": 1, "cities": []}
    [body] = chat_bodies(fake_vllm)
    assert body["return_token_ids"] is True and body["logprobs"] is True

    [t] = recorded(proxy, "dspy", 1)
    assert_complete(t, agent="dspy")
    assert t["text"] == ANSWER_FIELDS
    assert "What is 3 + 4?" in t["messages"][-1]["content"]


def dspy_fields(**fields: str) -> str:
    return "".join(f"[[ ## {k} ## ]]\n{v}\n\n" for k, v in fields.items()) + "[[ ## completed ## ]]"


@pytest.mark.models("frameworks-venv")
def test_dspy_react_agent_with_a_tool(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    """DSPy's ReAct writes its tool calls as fields of its text format (native tool calls it
    sends only for models litellm knows to support them): the tool runs, and its observation is
    in the next call's prompt."""
    call = {"next_thought": "The weather.", "next_tool_name": "get_weather"}
    fake_vllm.replies = [
        dspy_fields(**call, next_tool_args='{"city": "Paris"}'),
        dspy_fields(next_thought="Done.", next_tool_name="finish", next_tool_args="{}"),
        dspy_fields(reasoning="It said so.", answer="Sunny in Paris."),
    ]
    out = client_runs.python_client(
        "dspy_predict.py", config(proxy, "dspy-react", "dspy", react=True)
    )
    assert out == {"answer": "Sunny in Paris.", "history": 3, "cities": ["Paris"]}

    first, second, third = recorded(proxy, "dspy-react", 3)
    for t in (first, second, third):
        assert_complete(t, agent="dspy")
    assert "get_weather" in first["text"]
    assert "Sunny in Paris." not in json.dumps(first["messages"])
    assert "Sunny in Paris." in json.dumps(second["messages"])
    assert third["text"].endswith("[[ ## completed ## ]]")


@pytest.mark.models("frameworks-venv")
@pytest.mark.parametrize("through_litellm", [False, True])
def test_crewai_crew(proxy: RunningProxy, fake_vllm: FakeVLLM, through_litellm: bool) -> None:
    episode = f"crew-{through_litellm}"
    fake_vllm.replies = ["Thought: I now know the final answer\nFinal Answer: 7"]
    out = client_runs.python_client(
        "crewai_crew.py", config(proxy, episode, "crew", litellm=through_litellm)
    )
    assert out["answer"] == "7"
    assert (out["llm"] == "LLM") is through_litellm  # LLM is litellm's; OpenAICompletion not

    [t] = recorded(proxy, episode, 1)
    assert_complete(t, agent="crew")
    assert t["text"].endswith("Final Answer: 7")
    assert "What is 3 + 4?" in t["messages"][-1]["content"]


@pytest.mark.models("frameworks-venv")
@pytest.mark.parametrize("mode", ["chat", "stream"])
def test_llamaindex_openai_like(proxy: RunningProxy, mode: str) -> None:
    episode = f"li-{mode}"
    out = client_runs.python_client("llamaindex_chat.py", config(proxy, episode, "li", mode=mode))
    assert out["text"]

    [t] = recorded(proxy, episode, 1)
    assert_complete(t, agent="li")
    assert t["text"] == out["text"]
    assert t["messages"] == MESSAGES
    assert len(t["completion_token_ids"]) <= 8


@pytest.mark.models("frameworks-venv")
def test_llamaindex_chat_with_tools(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    out = client_runs.python_client(
        "llamaindex_chat.py", config(proxy, "li-tool", "li", mode="tool", question=CALL_A_TOOL)
    )
    [call] = out["calls"]
    assert (call["name"], call["arguments"]) == ("get_weather", {"city": "Paris"})
    assert chat_bodies(fake_vllm)[-1]["tool_choice"] == "required"

    [t] = recorded(proxy, "li-tool", 1)
    assert_complete(t, agent="li")
    [stored] = t["tool_calls"]
    assert stored["id"] == call["id"] and stored["function"]["name"] == "get_weather"


@pytest.mark.parametrize("mode", ["chat", "stream", "tool"])
def test_openai_node(proxy: RunningProxy, mode: str) -> None:
    episode = f"node-{mode}"
    question = CALL_A_TOOL if mode == "tool" else MESSAGES[0]["content"]
    out = client_runs.node_client(config(proxy, episode, "node", mode=mode, question=question))

    [t] = recorded(proxy, episode, 1)
    assert_complete(t, agent="node")
    assert t["messages"] == [{"role": "user", "content": question}]
    assert out["usage"]["completion_tokens"] == len(t["completion_token_ids"])
    if mode == "tool":
        [call] = out["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert t["tool_calls"] == [call]
    else:
        assert out["text"] and t["text"] == out["text"]
    if mode != "stream":
        assert out["transition_id"] == t["id"]


@pytest.mark.models("frameworks-venv")
def test_crewai_agent_with_a_tool(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    """CrewAI's own OpenAI provider calls tools natively: the fake calls get_weather, CrewAI runs
    it and sends its result back, and the next answer is the task's."""
    run = config(proxy, "crew-tool", "crew", tool=True, question=CALL_A_TOOL)
    out = client_runs.python_client("crewai_crew.py", run)
    assert out["cities"] == ["Paris"]
    assert [len(body.get("tools", [])) for body in chat_bodies(fake_vllm)] == [1, 1]

    first, second = recorded(proxy, "crew-tool", 2)
    for t in (first, second):
        assert_complete(t, agent="crew")
    [stored] = first["tool_calls"]
    assert stored["function"]["name"] == "get_weather"
    assert {"role": "tool", "tool_call_id": stored["id"], "content": "Sunny in Paris."} in [
        {k: m.get(k) for k in ("role", "tool_call_id", "content")} for m in second["messages"]
    ]
    assert second["text"] == out["answer"]
