"""Models served by providers through litellm (FLYWHEEL_ROUTES, issue 15 part 4): the setting
(pure), and a proxy with routes, run as its own process in the litellm install (tests/models.py's
litellm-venv, as in its image), called by today's openai client: a routed call goes through
litellm to an OpenAI-compatible provider (the fake vLLM at its own URL and key), comes back as
the provider sent it, streaming included, and is recorded as a transition of its agent and
episode, with its provider, tokens and price, never claimed by a trainer, and exported."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import psycopg
import pytest
from pydantic import ValidationError

from core import export
from demo.vllm_server import free_port
from fakes.processes import start_flywheel
from fakes.vllm import FakeVLLM
from proxy.config import ProviderModel, ProxySettings
from tests import models
from tests.conftest import fresh_database, trainer_claims

KEY = "sk-provider-test"

# --- the setting ----------------------------------------------------------------------------


def test_routes_are_read_from_pairs_or_json() -> None:
    pairs = ProxySettings(routes="gpt-4.1=openai/gpt-4.1, claude = anthropic/claude-sonnet-4-5")
    assert pairs.routes == {
        "gpt-4.1": ProviderModel(model="openai/gpt-4.1"),
        "claude": ProviderModel(model="anthropic/claude-sonnet-4-5"),
    }
    assert pairs.routes["claude"].provider == "anthropic"
    os.environ["FLYWHEEL_TEST_ROUTE_KEY"] = "sk-x"
    try:
        routes = orjson.dumps(
            {
                "local": {
                    "model": "hosted_vllm/qwen",
                    "api_base": "http://gpu:8000/v1",
                    "api_key_env": "FLYWHEEL_TEST_ROUTE_KEY",
                    "input_cost_per_token": 1e-7,
                },
                "gpt": "openai/gpt-4.1",
            }
        ).decode()
        parsed = ProxySettings(routes=routes).routes
    finally:
        del os.environ["FLYWHEEL_TEST_ROUTE_KEY"]
    assert parsed["local"].api_base == "http://gpu:8000/v1"
    assert parsed["local"].input_cost_per_token == 1e-7
    assert parsed["gpt"] == ProviderModel(model="openai/gpt-4.1")
    assert ProxySettings().routes == {}


@pytest.mark.parametrize(
    ("routes", "why"),
    [
        ("gpt-4.1", "not name=provider/model"),
        ("gpt=gpt-4.1", "String should match pattern"),  # litellm's <provider>/<model>
        ('{"gpt": {"model": "openai/x", "api_kye": "k"}}', "Extra inputs"),  # a typo
        ('["openai/x"]', "must be an object"),
        ('{"gpt": {"model": "openai/x", "api_key_env": "FLYWHEEL_UNSET_KEY"}}', "is not set"),
        ("policy=openai/gpt-4.1", "the policy alias"),
    ],
)
def test_a_bad_route_setting_says_what_is_wrong(routes: str, why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        ProxySettings(routes=routes)


# --- a proxy with routes, in its image's install --------------------------------------------


class RoutedProxy:
    def __init__(self, url: str, database_url: str) -> None:
        self.url, self.database_url = url, database_url

    def client(self, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, default_headers=headers
        )

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url) as conn:
            return conn.execute(sql, params).fetchall()

    def wait_rows(self, sql: str, n: int, *params: Any) -> list[tuple[Any, ...]]:
        deadline = time.monotonic() + 10
        while len(rows := self.rows(sql, *params)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return rows


@pytest.fixture(scope="module")
def routed(
    postgres_url: str, fake_vllm_server: FakeVLLM, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RoutedProxy]:
    """One proxy for the module, run by the litellm install's interpreter: vLLM (the fake)
    serves `policy`; `frontier` is routed through litellm to the same fake as an
    OpenAI-compatible provider at its own base URL and key, `nowhere` to a port nobody listens
    on."""
    venv = models.built("litellm-venv")
    routes = {
        "frontier": {
            "model": "openai/demo",
            "api_base": fake_vllm_server.url + "/v1",
            "api_key_env": "FRONTIER_KEY",
            "input_cost_per_token": 1e-6,
            "output_cost_per_token": 2e-6,
        },
        "nowhere": {
            "model": "openai/demo",
            "api_base": f"http://127.0.0.1:{free_port()}/v1",
            "api_key_env": "FRONTIER_KEY",
        },
    }
    settings = {
        "FRONTIER_KEY": KEY,
        "FLYWHEEL_ROUTES": orjson.dumps(routes).decode(),
        "FLYWHEEL_ALIAS_REFRESH_S": "0.1",
    }
    with fresh_database(postgres_url) as url:
        server = start_flywheel(
            fake_vllm_server.url,
            url,
            home=tmp_path_factory.mktemp("routed"),
            settings=settings,
            python=str(venv / "bin" / "python"),
        )
        try:
            yield RoutedProxy(server.url, url)
        finally:
            server.stop()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


@pytest.mark.models("litellm-venv")
def test_routed_calls_go_through_litellm_and_are_recorded_untrainable(
    routed: RoutedProxy, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    client = routed.client(**{"X-Episode-Id": episode, "X-Task-Id": "sum", "X-Agent-Name": "boss"})
    ask = [{"role": "user", "content": "What is 2+3?"}]

    # A frontier call with a tool: the provider's answer, as it sent it.
    raw = client.chat.completions.with_raw_response.create(
        model="frontier",
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=16,
    )
    answer = raw.parse()
    (tool_call,) = answer.choices[0].message.tool_calls or []
    assert tool_call.function.name == "add" and set(orjson.loads(tool_call.function.arguments))
    assert raw.headers["X-Policy-Version"] == "none" and raw.headers["X-Episode-Id"] == episode
    # It reached the provider through litellm: its key, its model name, nothing of vLLM's.
    (sent,) = [r for r in fake_vllm.requests if r["path"] == "/v1/chat/completions"]
    assert sent["headers"]["Authorization"] == f"Bearer {KEY}"
    assert sent["body"]["model"] == "demo" and "return_token_ids" not in sent["body"]
    assert sent["body"]["tools"] == TOOLS

    # Streaming: the chunks as they come; no usage chunk, as this client asked for none.
    chunks = list(
        client.chat.completions.create(
            model="frontier",
            messages=[
                *ask,
                {"role": "assistant", "content": "5"},
                {"role": "user", "content": "And 4+4?"},
            ],
            max_tokens=8,
            stream=True,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # The same agent's policy call, in the same episode, still goes to vLLM with its token ids.
    policy = client.chat.completions.create(model="policy", messages=ask, max_tokens=4)

    recorded = routed.wait_rows(
        "SELECT model_requested, model_used, provider, lineage, policy_version, "
        "prompt_token_ids IS NULL, logprobs IS NULL, text, tool_calls, prompt_tokens, "
        "completion_tokens, cost_usd, agent_name, task_id, status "
        "FROM transition WHERE episode_id = %s ORDER BY requested_at",
        3,
        episode,
    )
    tool_row, stream_row, policy_row = recorded
    assert tool_row[:7] == ("frontier", "openai/demo", "openai", None, None, True, True)
    assert tool_row[8][0]["function"] == {"name": "add", "arguments": tool_call.function.arguments}
    assert tool_row[12:] == ("boss", "sum", "ok")
    usage = answer.usage
    assert usage is not None and tool_row[9:11] == (usage.prompt_tokens, usage.completion_tokens)
    assert tool_row[11] == pytest.approx(
        usage.prompt_tokens * 1e-6 + usage.completion_tokens * 2e-6
    )
    assert stream_row[:3] == ("frontier", "openai/demo", "openai") and stream_row[7] == streamed
    assert stream_row[9] > 0 and stream_row[10] > 0 and stream_row[11] > 0  # the usage it hid
    assert policy_row[:6] == ("policy", "demo", None, "policy", 0, False)
    assert policy_row[7] == policy.choices[0].message.content

    # The episode's reward reaches every call; a trainer takes only the policy's.
    r = httpx.post(routed.url + "/v1/rewards", json={"episode_id": episode, "reward": 1.0})
    assert r.status_code == 200, r.text
    returns = routed.wait_rows(
        'SELECT "return" FROM transition WHERE episode_id = %s AND "return" IS NOT NULL', 3, episode
    )
    assert [x for (x,) in returns] == [1.0, 1.0, 1.0]
    (mine,) = [c for c in trainer_claims(routed.database_url) if c.episode_id == episode]
    assert mine.policy_version == 0 and mine.prompt_token_ids and mine.completion_token_ids

    # Exported like the rest, marked by their provider.
    out = tmp_path / "sum.jsonl"
    export.export(routed.database_url, out, where=export.ExportFilter(task="sum"))
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [(r["provider"], r["cost_usd"] is not None) for r in rows] == [
        ("openai", True),
        ("openai", True),
        (None, False),
    ]

    # And the model list names them, owned by their provider.
    listed = {m.id: m.owned_by for m in client.models.list()}
    assert listed["frontier"] == "openai" and listed["policy"] == "flywheel"


@pytest.mark.models("litellm-venv")
def test_a_body_cannot_steer_litellm(routed: RoutedProxy, fake_vllm: FakeVLLM) -> None:
    """Fields litellm would take as its own arguments (where to send the call, with which key,
    or a canned answer) go to the provider as unknown fields instead: the call still reaches
    the route's provider with the route's key."""
    body = {
        "model": "frontier",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "base_url": "http://127.0.0.1:9/v1",
        "api_base": "http://127.0.0.1:9/v1",
        "api_key": "sk-stolen",
        "mock_response": "pwned",
        "custom_llm_provider": "x",
    }
    r = httpx.post(routed.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] != "pwned"
    (sent,) = [q for q in fake_vllm.requests if q["path"] == "/v1/chat/completions"]
    assert sent["headers"]["Authorization"] == f"Bearer {KEY}"
    assert sent["body"]["mock_response"] == "pwned"  # passed on as an unknown field, unused


@pytest.mark.models("litellm-venv")
def test_a_providers_refusal_reaches_the_client_and_is_recorded(
    routed: RoutedProxy, fake_vllm: FakeVLLM
) -> None:
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    client = routed.client(**{"X-Episode-Id": episode})
    ask = [{"role": "user", "content": "Hi"}]
    slow_down = {
        "error": {
            "message": "Rate limit reached",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    fake_vllm.fail_next(1, 429, slow_down)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="frontier", messages=ask)
    assert "Rate limit reached" in str(limited.value)
    fake_vllm.fail_next(1, 400, {"error": {"message": "bad things", "type": "BadRequestError"}})
    with pytest.raises(openai.BadRequestError):  # refused before the stream's first byte
        client.chat.completions.create(model="frontier", messages=ask, stream=True)
    with pytest.raises(openai.APIStatusError) as unreachable:
        client.chat.completions.create(model="nowhere", messages=ask)
    assert unreachable.value.status_code == 502
    # Only chat completions are routed: the others say so.
    r = httpx.post(routed.url + "/v1/completions", json={"model": "frontier", "prompt": "Hi"})
    assert r.status_code == 400 and "chat/completions only" in r.json()["error"]["message"]
    r = httpx.post(routed.url + "/v1/responses", json={"model": "frontier", "input": "Hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    for bad in ({"model": "frontier"}, {"model": "frontier", "messages": "Hi"}):
        r = httpx.post(routed.url + "/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text

    failed = routed.wait_rows(
        "SELECT model_requested, provider, status, http_status, error->'error'->>'message' "
        "FROM transition WHERE episode_id = %s ORDER BY requested_at",
        3,
        episode,
    )
    assert [f[:4] for f in failed] == [
        ("frontier", "openai", "failed", 429),
        ("frontier", "openai", "failed", 400),
        ("nowhere", "openai", "failed", 502),
    ]
    assert "Rate limit reached" in failed[0][4] and "bad things" in failed[1][4]


@pytest.mark.models("litellm-venv")
def test_a_client_that_leaves_a_routed_stream_is_recorded_as_aborted(
    routed: RoutedProxy, fake_vllm: FakeVLLM
) -> None:
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    fake_vllm.state.token_delay_s = 0.05
    body = {
        "model": "frontier",
        "messages": [{"role": "user", "content": "Tell a story"}],
        "max_tokens": 200,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        routed.url + "/v1/chat/completions",
        json=body,
        headers={"X-Episode-Id": episode},
        timeout=30,
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in got)
    (row,) = routed.wait_rows(
        "SELECT status, provider, length(text) > 0 FROM transition WHERE episode_id = %s",
        1,
        episode,
    )
    assert row == ("aborted", "openai", True)


@pytest.mark.models("litellm-venv")
def test_a_routed_call_is_capped_in_choices_and_bytes(
    routed: RoutedProxy, fake_vllm: FakeVLLM
) -> None:
    """Every choice and byte of a routed call is paid on the operator's key: `n` above
    FLYWHEEL_ROUTE_MAX_N (8) is a 400, a body above FLYWHEEL_ROUTE_MAX_BODY_BYTES (4 MiB) a 413,
    both before any provider is called."""
    base = {"model": "frontier", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    url = routed.url + "/v1/chat/completions"
    many = httpx.post(url, json=base | {"n": 9}, timeout=30)
    assert many.status_code == 400, many.text
    error = many.json()["error"]
    assert (error["param"], error["code"]) == ("n", "n_too_large")
    assert "FLYWHEEL_ROUTE_MAX_N" in error["message"]
    big = base | {"messages": [{"role": "user", "content": "x" * (4 * 2**20)}]}
    large = httpx.post(url, json=big, timeout=30)
    assert large.status_code == 413, large.text
    assert "FLYWHEEL_ROUTE_MAX_BODY_BYTES" in large.json()["error"]["message"]
    assert [q for q in fake_vllm.requests if q["path"] == "/v1/chat/completions"] == []
    within = httpx.post(url, json=base | {"n": 8}, timeout=30)
    assert within.status_code == 200, within.text
    assert len(within.json()["choices"]) == 8
