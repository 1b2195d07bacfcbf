"""Bad input at Anthropic's Messages route (`/v1/messages`): clear 400/413/415 answers in
Anthropic's error shape, never a 500, nothing sent to vLLM and nothing stored; vLLM's own errors
and the proxy's (unreachable, a bug) re-said in that shape; its key as `x-api-key` too. The other
routes keep OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy
from tests.proxy.test_edge import CHAT, assert_openai_error, stored

ASK = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
JSON = {"Content-Type": "application/json"}


def assert_anthropic_error(response: Any, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])


BAD = [
    b"",
    b"{not json",
    b"[1, 2]",
    b'"a string"',
    b'{"model": "demo", "max_tokens": 4}',
    b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}',
]
CHANGES: list[dict[str, Any]] = [
    {"model": 7},
    {"max_tokens": "4"},
    {"max_tokens": 0},
    {"max_tokens": True},
    {"messages": []},
    {"messages": "hi"},
    {"messages": [5]},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": "x"}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": 5}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": "a.png"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": [5]}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": 5}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_addition", "tool": {}}]}]},
    {"system": 5},
    {"system": [{"type": "text"}]},
    {"stop_sequences": "\n"},
    {"stop_sequences": [1]},
    {"temperature": "hot"},
    {"top_p": [1]},
    {"top_k": 1.5},
    {"stream": "yes"},
    {"metadata": "m"},
    {"tools": "calculator"},
    {"tools": [{"input_schema": {}}]},
    {"tools": [{"name": "web_search", "type": "web_search_20250305"}]},
    {"tool_choice": "auto"},
    {"tool_choice": {"type": "maybe"}},
    {"tool_choice": {"type": "tool"}},
]


@pytest.mark.parametrize("raw", BAD + [orjson.dumps({**ASK, **c}) for c in CHANGES])
def test_malformed_messages_requests_are_400s_that_never_reach_vllm(
    proxy: RunningProxy, fake_vllm: FakeVLLM, raw: bytes
) -> None:
    r = proxy.client().post("/v1/messages", content=raw, headers=JSON)
    assert_anthropic_error(r, 400, "invalid_request_error")
    assert fake_vllm.requests == []
    assert stored(proxy) == 0


def test_huge_bodies_wrong_types_and_methods(make_proxy: Any, fake_vllm: FakeVLLM) -> None:
    proxy = make_proxy(max_body_bytes=4096)
    huge = {**ASK, "messages": [{"role": "user", "content": "x" * 10_000}]}
    r = proxy.client().post("/v1/messages", json=huge)
    assert "exceeds the limit" in assert_anthropic_error(r, 413, "request_too_large")
    r = proxy.client().post("/v1/messages", content=b"{}", headers={"Content-Type": "text/plain"})
    assert_anthropic_error(r, 415, "invalid_request_error")
    assert_anthropic_error(proxy.client().get("/v1/messages"), 405, "invalid_request_error")
    bad_tags = proxy.client(**{"X-Episode-Id": "x" * 1000}).post("/v1/messages", json=ASK)
    assert_anthropic_error(bad_tags, 400, "invalid_request_error")
    assert fake_vllm.requests == [] and stored(proxy) == 0


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (404, "not_found_error"), (500, "api_error")],
)
def test_vllm_errors_are_said_in_anthropic_s_shape_and_recorded_as_vllm_sent_them(
    proxy: RunningProxy, fake_vllm: FakeVLLM, status: int, kind: str
) -> None:
    error = {"error": {"message": "vLLM says no", "type": "X", "param": None, "code": status}}
    fake_vllm.fail_next(1, status, error)
    r = proxy.client(**{"X-Episode-Id": "refused"}).post("/v1/messages", json=ASK)
    assert assert_anthropic_error(r, status, kind) == "vLLM says no"
    assert r.headers["x-transition-id"]
    rows = proxy.wait_rows("SELECT status, http_status, error FROM transition", 1)
    assert rows == [("failed", status, error)]


def test_vllm_s_own_validation_error_reaches_the_client(proxy: RunningProxy) -> None:
    r = proxy.client().post("/v1/messages", json={**ASK, "max_tokens": 100_000})
    assert "max_model_len" in assert_anthropic_error(r, 400, "invalid_request_error")


def test_an_unreachable_vllm_is_a_502_api_error(make_proxy: Any) -> None:
    proxy = make_proxy(upstream=["http://127.0.0.1:9"], base_model="demo")
    r = proxy.client().post("/v1/messages", json=ASK)
    assert "unreachable" in assert_anthropic_error(r, 502, "api_error")
    assert proxy.wait_rows("SELECT status FROM transition", 1) == [("failed",)]


def test_a_bug_is_a_500_api_error_that_does_not_leak(
    proxy: RunningProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("proxy.relay.forward.Forwarder.handle", broken)
    message = assert_anthropic_error(
        proxy.client().post("/v1/messages", json=ASK), 500, "api_error"
    )
    assert "internal error" in message and "a bug" not in message
    assert_openai_error(proxy.client().post("/v1/chat/completions", json=CHAT), 500)


def test_the_key_may_come_as_x_api_key_here_only(make_proxy: Any, fake_vllm: FakeVLLM) -> None:
    proxy = make_proxy(api_keys="k1")
    missing = proxy.client().post("/v1/messages", json=ASK)
    assert_anthropic_error(missing, 401, "authentication_error")
    wrong = proxy.client(**{"x-api-key": "nope"}).post("/v1/messages", json=ASK)
    assert_anthropic_error(wrong, 401, "authentication_error")
    tagged = proxy.client(**{"x-api-key": "nope"}).post("/episode/e1/v1/messages", json=ASK)
    assert_anthropic_error(tagged, 401, "authentication_error")
    assert proxy.client(**{"x-api-key": "k1"}).post("/v1/messages", json=ASK).status_code == 200
    bearer = proxy.client(Authorization="Bearer k1").post("/v1/messages", json=ASK)
    assert bearer.status_code == 200
    elsewhere = proxy.client(**{"x-api-key": "k1"}).post("/v1/chat/completions", json=CHAT)
    assert_openai_error(elsewhere, 401)  # OpenAI's routes take OpenAI's header
    assert all(h.lower() != "x-api-key" for h in fake_vllm.requests[-1]["headers"])  # not sent on


TOOL = {"name": "calc", "input_schema": {"type": "object", "properties": {}}}


def test_messages_calls_are_trained_under_what_vllm_was_sent(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    """Found by reading: a Messages call records the Anthropic body as its params, and the
    trainer read them as a chat request: an `output_config.format` grammar (sent as
    `response_format`) went unseen, `thinking.budget_tokens` too, fields the proxy never sends
    (`min_p`, `logit_bias`, `repetition_penalty`) were applied, and `tool_choice` `{"type":
    "auto"}` was set aside as constrained. The records go through the trainer's claim and
    sampling here, as a step would read them."""
    from tests.conftest import trainer_claims
    from trainer.data.sampling import CONSTRAINED, UNSUPPORTED, Sampling, SetAside, sampling_of

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    cases: dict[str, tuple[dict[str, Any], Sampling | str]] = {
        "plain": ({"temperature": 0.7, "top_k": 20}, Sampling(temperature=0.7, top_k=20)),
        "dropped": (
            {"min_p": 0.5, "logit_bias": {"5": 100}, "repetition_penalty": 1.5},
            Sampling(),
        ),
        "auto": ({"tools": [TOOL], "tool_choice": {"type": "auto"}}, Sampling()),
        "any": ({"tools": [TOOL], "tool_choice": {"type": "any"}}, CONSTRAINED),
        "format": (
            {"output_config": {"format": {"type": "json_schema", "json_schema": schema}}},
            CONSTRAINED,
        ),
        "budget": ({"thinking": {"type": "enabled", "budget_tokens": 64}}, UNSUPPORTED),
    }
    with proxy.client() as c:
        for name, (extra, _) in cases.items():
            body = {**ASK, "model": "policy", **extra}
            r = c.post("/episode/m-" + name + "/v1/messages", json=body)
            assert r.status_code == 200, (name, r.text)
            c.post("/v1/rewards", json={"episode_id": "m-" + name, "reward": 1.0})
    proxy.wait_rows('SELECT 1 FROM transition WHERE "return" IS NOT NULL', len(cases))
    claimed = {c.episode_id.removeprefix("m-"): c for c in trainer_claims(proxy.database_url)}
    assert set(claimed) == set(cases)
    for name, (_, expected) in cases.items():
        c = claimed[name]
        assert c.route == "messages"
        got = sampling_of(c.params, {}, made_tool_call=c.made_tool_call, route=c.route)
        if isinstance(expected, Sampling):
            assert got == expected, name
        else:
            assert isinstance(got, SetAside) and got.reason == expected, (name, got)
