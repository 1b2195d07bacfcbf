"""POST /v1/demonstrations (issue 41): posted prompts with their answers, copies of a recorded
episode's calls, idempotency, and every refusal a bad post gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core import export, tenants
from core.codecs import unpack
from core.database import Sessions
from flywheel.client import Demonstration, Flywheel, RequestRejected
from tests.conftest import RunningProxy

PROMPT = [{"role": "system", "content": "Answer with a call."}, {"role": "user", "content": "2+2?"}]
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def post(proxy: RunningProxy, body: Any, **headers: str) -> Any:
    return proxy.client(**headers).post("/v1/demonstrations", json=body)


def rows(proxy: RunningProxy) -> list[tuple[Any, ...]]:
    return proxy.query(
        "SELECT lineage, tenant, source, messages, completion, idempotency_key, episode_id, "
        "task_id, agent_name FROM demonstration ORDER BY created_at, id"
    )


def test_a_posted_demonstration_is_stored_for_the_callers_policy(proxy: RunningProxy) -> None:
    r = post(proxy, {"messages": PROMPT, "completion": "[add(a=2, b=2)]", "task_id": "t1"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "demonstration" and out["status"] == "created"
    assert out["lineage"] == "policy" and out["source"] == "posted"
    [(lineage, tenant, source, messages, completion, _, episode, task, agent)] = rows(proxy)
    assert (lineage, tenant, source, episode, task, agent) == (
        "policy",
        None,
        "posted",
        None,
        "t1",
        None,
    )
    assert messages == PROMPT
    assert completion == {"role": "assistant", "content": "[add(a=2, b=2)]"}


def test_a_list_with_tool_calls_and_an_agents_lineage(make_proxy: Any) -> None:
    proxy = make_proxy(adapter_per_agent={"writer": "writer"})
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    r = post(
        proxy,
        [
            {
                "messages": PROMPT,
                "completion": {"role": "assistant", "tool_calls": [call]},
                "agent": "writer",
                "tools": [{"type": "function", "function": {"name": "add"}}],
            },
            {"messages": PROMPT, "completion": "plain", "agent": "someone-else"},
            {"messages": PROMPT, "completion": "named", "lineage": "writer"},
        ],
    )
    assert r.status_code == 200, r.text
    assert [d["lineage"] for d in r.json()["data"]] == ["writer", "policy", "writer"]
    agents = {str(s[4].get("content")): (s[0], s[8]) for s in rows(proxy)}
    assert agents == {
        "None": ("writer", "writer"),
        "plain": ("policy", "someone-else"),
        "named": ("writer", None),
    }
    assert [s[4] for s in rows(proxy) if s[8] == "writer"] == [
        {"role": "assistant", "tool_calls": [call]}
    ]


def test_a_repeat_with_the_same_key_is_a_duplicate(proxy: RunningProxy) -> None:
    body = {"messages": PROMPT, "completion": "x", "idempotency_key": "k1"}
    first = post(proxy, body).json()
    again = post(proxy, body).json()
    assert (first["status"], again["status"]) == ("created", "duplicate")
    assert first["id"] == again["id"] and len(rows(proxy)) == 1
    # Without a key, a repeat is another demonstration (as a repeated reward without one).
    post(proxy, {"messages": PROMPT, "completion": "x"})
    post(proxy, {"messages": PROMPT, "completion": "x"})
    assert len(rows(proxy)) == 3


def test_an_episodes_calls_are_copied_with_their_token_ids_once(proxy: RunningProxy) -> None:
    headers = {"X-Episode-Id": "good", "X-Task-Id": "t"}
    with proxy.client(**headers) as c:
        for _ in range(2):
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    r = post(proxy, {"from_episode": "good"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["status"] for d in data] == ["created", "created"]
    assert all(d["source"] == "episode" and d["lineage"] == "policy" for d in data)
    copied = proxy.query(
        "SELECT d.prompt_token_ids, d.completion_token_ids, d.episode_id, d.task_id, "
        "t.completion_token_ids FROM demonstration d JOIN transition t ON t.id = d.transition_id"
    )
    assert len(copied) == 2
    for prompt, completion, episode, task, recorded in copied:
        assert unpack(completion, "i") == unpack(recorded, "i") and unpack(prompt, "i")
        assert (episode, task) == ("good", "t")
    again = post(proxy, {"from_episode": "good"}).json()["data"]
    assert sorted(d["status"] for d in again) == ["duplicate", "duplicate"]
    assert {d["id"] for d in again} == {d["id"] for d in data}


def test_an_episode_without_policy_calls_has_nothing_to_demonstrate(proxy: RunningProxy) -> None:
    chat = {**CHAT, "model": "demo"}  # the base model by name: no lineage served it
    with proxy.client(**{"X-Episode-Id": "base"}) as c:
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
    r = post(proxy, {"from_episode": "base"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "nothing_to_demonstrate"
    r = post(proxy, {"from_episode": "never-seen"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "episode_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": PROMPT}, None),  # no answer
        ({"completion": "x"}, None),  # no prompt
        ({"messages": PROMPT, "completion": "   "}, None),  # an empty answer
        ({"messages": PROMPT, "completion": {"role": "assistant", "content": ""}}, "completion"),
        ({"messages": [], "completion": "x"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}], "completion": "x"}, "messages.0.role"),
        ({"messages": PROMPT, "completion": 5}, "completion"),
        ({"messages": PROMPT, "completion": "x", "from_episode": "e"}, None),
        ({"messages": PROMPT, "completion": "x", "lineage": "no spaces"}, "lineage"),
        ({"messages": PROMPT, "completion": "x", "color": "red"}, "color"),
        ({"messages": PROMPT, "completion": "x", "episode_id": "a/b"}, "episode_id"),
    ],
)
def test_bad_demonstrations_are_refused_naming_the_field(
    proxy: RunningProxy, body: dict[str, Any], param: str | None
) -> None:
    r = post(proxy, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_demonstration"
    if param is not None:
        assert error["param"].startswith(param), error
    assert rows(proxy) == []


def test_a_bad_item_refuses_the_whole_list(proxy: RunningProxy) -> None:
    r = post(proxy, [{"messages": PROMPT, "completion": "ok"}, {"messages": PROMPT}])
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("[1]")
    assert rows(proxy) == []
    for body in ([], [{"messages": PROMPT, "completion": "x"}] * 1001, "text", 3):
        assert post(proxy, body).status_code == 400
    keyed = {"messages": PROMPT, "completion": "x", "idempotency_key": "same"}
    assert post(proxy, [keyed, keyed]).status_code == 400
    assert rows(proxy) == []


def test_an_unknown_lineage_is_refused_with_the_ones_served(proxy: RunningProxy) -> None:
    r = post(proxy, {"messages": PROMPT, "completion": "x", "lineage": "writer"})
    assert r.status_code == 400, r.text
    assert (
        r.json()["error"]["code"] == "unknown_lineage" and "policy" in r.json()["error"]["message"]
    )


def test_another_tenants_lineage_and_episode_are_refused(
    make_proxy: Any, sessions: Sessions
) -> None:
    proxy = make_proxy(auth="keys", keys_refresh_s=0.1)
    with sessions.begin() as session:
        _, acme = tenants.create_key(session=session, tenant="acme", scopes=["infer", "reward"])
        _, globex = tenants.create_key(session=session, tenant="globex", scopes=["reward"])
        _, reader = tenants.create_key(session=session, tenant="initech", scopes=["read"])
    proxy.wait_keys(acme, globex, reader)
    auth = {"Authorization": f"Bearer {acme}"}
    with proxy.client(**auth, **{"X-Episode-Id": "mine"}) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    # acme's own: its lineage is its own policy, its episode ids its own.
    r = post(proxy, {"messages": PROMPT, "completion": "x", "episode_id": "e1"}, **auth)
    assert r.status_code == 200 and r.json()["lineage"] == "acme.policy"
    copied = post(proxy, {"from_episode": "mine"}, **auth)
    assert copied.status_code == 200 and copied.json()["data"][0]["lineage"] == "acme.policy"
    other = {"Authorization": f"Bearer {globex}"}
    r = post(proxy, {"messages": PROMPT, "completion": "x", "lineage": "acme.policy"}, **other)
    assert r.status_code == 403 and r.json()["error"]["code"] == "lineage_forbidden"
    r = post(proxy, {"messages": PROMPT, "completion": "x", "lineage": "policy"}, **other)
    assert r.status_code == 403  # the shared lineage: globex has not opted in
    r = post(proxy, {"from_episode": "mine"}, **other)  # globex's "mine": none
    assert r.status_code == 404
    r = post(proxy, {"messages": PROMPT, "completion": "x"}, Authorization=f"Bearer {reader}")
    assert r.status_code == 403  # a read-only key may not post training data
    assert proxy.query("SELECT tenant, episode_id FROM demonstration ORDER BY source") == [
        ("acme", "acme/mine"),
        ("acme", "acme/e1"),
    ]


def test_demonstrations_export_with_their_tenant_and_token_ids(
    make_proxy: Any, sessions: Sessions, tmp_path: Path
) -> None:
    proxy = make_proxy(auth="keys", keys_refresh_s=0.1, admin_key="admin")
    with sessions.begin() as session:
        _, acme = tenants.create_key(
            session=session, tenant="acme", scopes=["infer", "reward", "read"]
        )
        _, globex = tenants.create_key(session=session, tenant="globex", scopes=["reward", "read"])
    proxy.wait_keys(acme, globex)
    auth = {"Authorization": f"Bearer {acme}"}
    with proxy.client(**auth, **{"X-Episode-Id": "good", "X-Task-Id": "t"}) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    post(proxy, {"from_episode": "good"}, **auth)
    post(proxy, {"messages": PROMPT, "completion": "[add(a=2, b=2)]", "task_id": "t2"}, **auth)
    post(proxy, {"messages": PROMPT, "completion": "theirs"}, Authorization=f"Bearer {globex}")

    done = export.export(
        proxy.database_url, tmp_path / "d.jsonl", kind="demonstrations", tokens=True
    )
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert done.rows == 3 and {r["tenant"] for r in rows} == {"acme", "globex"}
    copied = next(r for r in rows if r["source"] == "episode")
    assert (
        copied["messages"][0] == CHAT["messages"][0]
        and copied["messages"][-1]["role"] == "assistant"
    )
    assert copied["completion_token_ids"] and copied["prompt_token_ids"]
    posted = next(r for r in rows if r["task_id"] == "acme/t2")
    assert posted["messages"] == [*PROMPT, {"role": "assistant", "content": "[add(a=2, b=2)]"}]
    # Through the proxy: a tenant's own, under its own ids; a filter demonstrations lack: 400.
    with proxy.client(**auth) as c:
        r = c.get("/v1/export", params={"kind": "demonstrations"})
        assert r.status_code == 200, r.text
        mine = [json.loads(line) for line in r.text.splitlines()]
        assert {m["tenant"] for m in mine} == {"acme"} and {m["task_id"] for m in mine} == {
            "t",
            "t2",
        }
        r = c.get("/v1/export", params={"kind": "demonstrations", "version": 1})
        assert r.status_code == 400 and "no version" in r.json()["error"]["message"]
    # The dashboard counts them, each tenant its own.
    with proxy.client(Authorization="Bearer admin") as c:
        overview = c.get("/ui/api/overview").json()
    assert {(d["lineage"], d["total"], d["waiting"]) for d in overview["demonstrations"]} == {
        ("acme.policy", 2, 2),
        ("globex.policy", 1, 1),
    }


def test_the_client_posts_demonstrations_and_copies_episodes(proxy: RunningProxy) -> None:
    with Flywheel(proxy.url) as fw:
        with fw.episode("t1", "solver") as episode:
            fw.openai().chat.completions.create(**CHAT)
        result = fw.demonstrate(PROMPT, "[add(a=2, b=2)]", agent="solver", idempotency_key="k")
        assert (result.status, result.lineage, result.source) == ("created", "policy", "posted")
        assert fw.demonstrate(PROMPT, "[add(a=2, b=2)]", idempotency_key="k").status == "duplicate"
        both = fw.demonstrations([Demonstration(PROMPT, "a"), Demonstration(PROMPT, "b")])
        assert [r.status for r in both] == ["created", "created"]
        [copied] = fw.demonstrate_episode(episode.id)
        assert copied.source == "episode" and copied.transition_id is not None
        with pytest.raises(RequestRejected, match="empty"):
            fw.demonstrate(PROMPT, " ")
    assert len(rows(proxy)) == 4
