"""Automatic intermediate rewards (proxy/record/air.py): tool calls checked against the declared
tools, penalised as `air` rewards that credit assignment adds; and tool failures a client
reports."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import text

from core import database
from core.record import TransitionRecord
from fakes.traffic import episode_records
from proxy.record.air import ToolCheck
from proxy.record.store.transitions import insert_transitions
from tests.conftest import RunningProxy
from tests.proxy.relay.test_responses import CALCULATOR

PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string", "pattern": "^[0-9 +*-]+$"}},
    "required": ["expression"],
    "additionalProperties": False,
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": PARAMETERS}}]


def record(*calls: tuple[str, Any], text: str = "") -> TransitionRecord:
    """A chat-shaped record whose choice made these (name, arguments) calls."""
    r = episode_records(random.Random(0), turns=1)[0]
    r.text = text
    r.tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ] or None
    return r


def kinds(errors: list[dict[str, Any]] | None) -> list[str]:
    return [e["kind"] for e in errors or ()]


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        ([("calculator", '{"expression": "3 + 4"}')], []),
        ([("calc", '{"expression": "3 + 4"}')], ["undeclared_tool"]),
        ([("calculator", '{"expression": 3 + 4}')], ["invalid_json"]),
        ([("calculator", '{"expr": "3 + 4"}')], ["schema_violation"]),
        ([("calculator", '{"expression": 7}')], ["schema_violation"]),
        ([("calculator", '{"expression": "seven"}')], ["schema_violation"]),
        ([("calculator", "[]")], ["schema_violation"]),
        (
            [("calculator", '{"expression": "1"}'), ("calc", "{}"), ("calculator", "{")],
            ["undeclared_tool", "invalid_json"],
        ),
    ],
)
def test_each_kind_of_bad_tool_call_is_found(calls: list[Any], expected: list[str]) -> None:
    errors = ToolCheck().errors(CHAT_TOOLS, record(*calls))
    assert kinds(errors) == expected
    for e in errors or ():
        assert e["detail"] and e["id"] == f"call_{e['index']}"


def test_a_schema_violation_says_what_is_wrong() -> None:
    [error] = ToolCheck().errors(CHAT_TOOLS, record(("calculator", '{"expr": "1"}'))) or []
    assert "'expression' is a required property" in error["detail"]
    [error] = ToolCheck().errors(CHAT_TOOLS, record(("calculator", '{"expression": 7}'))) or []
    assert error["detail"].startswith("expression: 7 is not of type 'string'")


def test_the_responses_tool_shape_is_read_too() -> None:
    responses_tools = [{**CALCULATOR, "parameters": PARAMETERS}]
    assert (
        ToolCheck().errors(responses_tools, record(("calculator", '{"expression": "1"}'))) is None
    )
    errors = ToolCheck().errors(responses_tools, record(("calculator", '{"x": 1}')))
    assert kinds(errors) == ["schema_violation"]


def test_the_messages_tool_shape_is_read_too() -> None:
    """Anthropic's Messages API declares {name, input_schema}; a server tool (a `type` of its
    own) cannot be judged."""
    tools: list[Any] = [{"name": "calculator", "input_schema": PARAMETERS}]
    assert ToolCheck().errors(tools, record(("calculator", '{"expression": "1"}'))) is None
    errors = ToolCheck().errors(tools, record(("calculator", '{"x": 1}'), ("add", "{}")))
    assert kinds(errors) == ["schema_violation", "undeclared_tool"]
    tools.append({"type": "web_search_20250305", "name": "web_search"})
    assert ToolCheck().errors(tools, record(("calculator", '{"x": 1}'))) is None


def test_a_call_the_server_could_not_parse_is_found_by_its_marker() -> None:
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 3 + 4}}\n</tool_call>'
    assert kinds(ToolCheck().errors(CHAT_TOOLS, record(text=bad))) == ["unparsed_call"]
    assert ToolCheck().errors(CHAT_TOOLS, record(text="7")) is None
    assert ToolCheck(marker="").errors(CHAT_TOOLS, record(text=bad)) is None


@pytest.mark.parametrize(
    "tools",
    [
        None,
        [],
        "calculator",
        [*CHAT_TOOLS, {"type": "web_search_preview"}],  # a built-in tool's calls look undeclared
    ],
)
def test_nothing_is_judged_without_function_tools_to_judge_by(tools: Any) -> None:
    assert ToolCheck().errors(tools, record(("calc", "{"))) is None


def test_a_tool_with_an_invalid_schema_is_held_only_to_its_name() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}]
    assert ToolCheck().errors(tools, record(("f", '{"any": 1}'))) is None
    assert kinds(ToolCheck().errors(tools, record(("f", "{")))) == ["invalid_json"]


# --- through the proxy (the fake vLLM calls the tool with arguments that break `pattern`) ----

ASK = {
    "model": "demo",
    "messages": [{"role": "user", "content": "Please call a tool."}],
    "tools": CHAT_TOOLS,
    "max_tokens": 40,
}


def episode(proxy: RunningProxy, episode_id: str) -> dict[str, Any]:
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = %s", 1, episode_id)
    return proxy.client().get(f"/v1/episodes/{episode_id}").json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_a_bad_call_is_penalised_and_the_penalty_is_in_the_return(
    make_proxy: Any, route: str
) -> None:
    proxy = make_proxy(air_penalty=0.5)
    if route == "chat":
        path, body = "/v1/chat/completions", ASK
    elif route == "messages":
        path = "/v1/messages"
        body = {
            "model": "demo",
            "messages": ASK["messages"],
            "max_tokens": 40,
            "tools": [{"name": "calculator", "input_schema": PARAMETERS}],
        }
    else:
        path = "/v1/responses"
        body = {
            "model": "demo",
            "input": "Please call a tool.",
            "max_output_tokens": 40,
            "tools": [{**CALCULATOR, "parameters": PARAMETERS}],
        }
    r = proxy.client(**{"X-Episode-Id": "air-1", "X-Task-Id": "t"}).post(path, json=body)
    assert r.status_code == 200, r.text
    [t] = episode(proxy, "air-1")["transitions"]
    assert t["tool_calls"][0]["function"]["arguments"] == '{"expression": "Paris"}'
    assert kinds(t["tool_errors"]) == ["schema_violation"]

    final = proxy.client().post("/v1/rewards", json={"episode_id": "air-1", "reward": 1.0})
    assert final.status_code == 200, final.text
    view = episode(proxy, "air-1")
    assert view["transitions"][0]["return"] == 0.5
    air = [x for x in view["rewards"] if x["source"] == "air"]
    assert [(x["transition_id"], x["reward"]) for x in air] == [(t["id"], -0.5)]
    metrics = proxy.client().get("/metrics").text
    assert 'flywheel_tool_call_errors_total{kind="schema_violation"}' in metrics


def test_a_good_call_and_air_off_cost_nothing(make_proxy: Any) -> None:
    proxy = make_proxy(air_penalty=0.5)
    good = {**ASK, "tools": [{"type": "function", "function": {"name": "calculator"}}]}
    proxy.client(**{"X-Episode-Id": "good"}).post("/v1/chat/completions", json=good)
    [t] = episode(proxy, "good")["transitions"]
    assert t["tool_calls"] and t["tool_errors"] is None
    proxy.stop()

    off = make_proxy()  # AIR off: nothing checked, nothing penalised
    off.client(**{"X-Episode-Id": "off"}).post("/v1/chat/completions", json=ASK)
    [t] = episode(off, "off")["transitions"]
    assert t["tool_calls"] and t["tool_errors"] is None
    assert off.query("SELECT count(*) FROM reward")[0][0] == 0


async def test_a_replayed_batch_adds_its_air_reward_once(database_url: str) -> None:
    engine, sessionmaker = database.create_async_sessions(database_url)
    records = episode_records(random.Random(0), turns=2)
    records[1].tool_errors = [{"index": 0, "kind": "undeclared_tool"}]
    for _ in range(2):  # a journal replay writes the batch again
        async with sessionmaker.begin() as session:
            await insert_transitions(records, session=session, gamma=None, air_penalty=0.2)
    async with sessionmaker() as session:
        rows = (
            await session.execute(text("SELECT transition_id::text, value, source FROM reward"))
        ).all()
    await engine.dispose()
    assert [tuple(r) for r in rows] == [(records[1].id, -0.2, "air")]


# --- tool failures a client reports -----------------------------------------------------------


def test_a_client_reports_a_failed_tool_run_by_its_call_id(proxy: RunningProxy) -> None:
    with proxy.client(**{"X-Episode-Id": "tool-run"}) as c:
        r = c.post("/v1/chat/completions", json=ASK)
        c.post("/v1/chat/completions", json={**ASK, "tools": None})
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    report = {
        "episode_id": "tool-run",
        "tool_call_id": call["id"],
        "reward": -1.0,
        "source": "tool",
    }
    posted = proxy.client().post("/v1/rewards", json=report)
    assert posted.status_code == 200, posted.text
    assert posted.json()["transition_id"] == r.headers["x-transition-id"]
    assert posted.json()["source"] == "tool"
    proxy.client().post("/v1/rewards", json={"episode_id": "tool-run", "reward": 1.0})
    view = episode(proxy, "tool-run")
    returns = {t["id"]: t["return"] for t in view["transitions"]}
    assert returns.pop(r.headers["x-transition-id"]) == 0.0 and list(returns.values()) == [1.0]
    assert [x["source"] for x in view["rewards"]] == ["tool", None]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"tool_call_id": "x", "transition_id": "00000000-0000-4000-8000-000000000000"}, 400, None),
        ({"source": "air"}, 400, "source"),
        ({"source": "has space"}, 400, "source"),
        ({"source": 7}, 400, "source"),
        ({"tool_call_id": ""}, 400, "tool_call_id"),
    ],
)
def test_bad_step_reports_are_refused_and_store_nothing(
    proxy: RunningProxy, body: dict[str, Any], status: int, param: str | None
) -> None:
    proxy.client(**{"X-Episode-Id": "e"}).post("/v1/chat/completions", json=ASK)
    proxy.wait_rows("SELECT 1 FROM transition WHERE episode_id = 'e'", 1)
    r = proxy.client().post("/v1/rewards", json={"episode_id": "e", "reward": -1.0, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert proxy.query("SELECT count(*) FROM reward")[0][0] == 0


def test_a_report_right_after_a_call_still_being_scored_finds_it(
    proxy: RunningProxy, fake_vllm: Any
) -> None:
    """A Responses output that is only a function call waits for its logprobs
    (proxy/relay/scoring.py) before it is queued; a step reward naming it must wait for it, not
    miss it."""
    fake_vllm.latency_s = 0.5  # the scoring call too: the reward arrives while it is out
    body = {"model": "demo", "input": "Please call a tool.", "tools": [CALCULATOR]}
    r = proxy.client(**{"X-Episode-Id": "scored"}).post("/v1/responses", json=body)
    [call] = [item for item in r.json()["output"] if item["type"] == "function_call"]
    report = {"episode_id": "scored", "tool_call_id": call["call_id"], "reward": -1.0}
    posted = proxy.client().post("/v1/rewards", json=report)
    assert posted.status_code == 200, posted.text
    assert posted.json()["transition_id"] == r.headers["x-transition-id"]
    assert [p["path"] for p in fake_vllm.requests] == ["/v1/responses", "/v1/completions"]
