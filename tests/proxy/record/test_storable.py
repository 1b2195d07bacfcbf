"""U+0000, which Postgres text and jsonb cannot hold, still gets recorded (as U+FFFD).

A tiny or broken model can sample it and a client can send it. Before this, such a transition was
refused by Postgres and set aside in the journal's rejected/ folder instead of being trained on.
"""

from __future__ import annotations

from typing import Any

from core.record import TransitionRecord
from fakes.vllm import FakeVLLM
from proxy.record import storable
from tests.conftest import RunningProxy


def record(**fields: Any) -> TransitionRecord:
    base: dict[str, Any] = {"id": "0", "episode_id": "e", "request_id": "0", "choice_index": 0}
    base |= {"requested_at": 0.0, "route": "chat", "status": "ok", "http_status": 200}
    base |= {"messages": [], "latency_ms": 0.0}
    return TransitionRecord(**(base | fields))


def test_pg_safe_replaces_nul_everywhere_and_nothing_else() -> None:
    value = {"a\x00": ["x\x00y", {"k": "\x00"}, 1, None, 2.5], "b": "plain"}
    assert storable.pg_safe(value) == {
        "a\ufffd": ["x\ufffdy", {"k": "\ufffd"}, 1, None, 2.5],
        "b": "plain",
    }
    assert storable.has_nul(record(text="ok\x00"))
    assert storable.has_nul(record(error={"message": "\x00"}))
    assert not storable.has_nul(record(text="ok", tool_calls=[{"arguments": "{}"}]))
    scrubbed = storable.pg_safe_record(record(text="a\x00", messages=[{"content": "\x00"}]))
    assert scrubbed.text == "a\ufffd" and scrubbed.messages == [{"content": "\ufffd"}]


def test_a_client_message_with_nul_is_forwarded_as_is_and_recorded(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 3}
    r = proxy.client(**{"X-Episode-Id": "nul"}).post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert fake_vllm.requests[-1]["body"]["messages"][0]["content"] == "a\x00b"  # untouched
    rows = proxy.wait_rows("SELECT status FROM transition WHERE episode_id = 'nul'", 1)
    assert rows == [("ok",)]
    [t] = proxy.client().get("/v1/episodes/nul").json()["transitions"]
    assert t["messages"][0]["content"] == "a\ufffdb"


def test_a_vllm_error_with_nul_is_recorded(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    fake_vllm.fail_next(1, 400, {"error": {"message": "bad \x00 input", "code": 400}})
    body = {"model": "demo", "messages": [{"role": "user", "content": "x"}]}
    r = proxy.client(**{"X-Episode-Id": "nul-err"}).post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad \x00 input"
    rows = proxy.wait_rows("SELECT status, error FROM transition WHERE episode_id = 'nul-err'", 1)
    assert rows == [("failed", {"error": {"message": "bad \ufffd input", "code": 400}})]


def test_a_reward_with_nul_in_its_key_is_stored(proxy: RunningProxy) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "x"}]}
    assert proxy.client(**{"X-Episode-Id": "nul-r"}).post("/v1/chat/completions", json=body)
    reward = {"episode_id": "nul-r", "reward": 1.0, "idempotency_key": "k\x00"}
    r = proxy.client().post("/v1/rewards", json=reward)
    assert r.status_code == 200, r.text
    assert proxy.query("SELECT idempotency_key FROM reward") == [("k\ufffd",)]
