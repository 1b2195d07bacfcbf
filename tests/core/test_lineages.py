"""One adapter lineage per agent role (issue 12), on the proxy's side: `policy` resolves per
request from the agent tag, each lineage has its own current version and rollback, and every
recorded transition says which lineage served it. Real Postgres, the fake vLLM."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from core import canary, naming, policy
from core.database import Sessions
from fakes.vllm import FakeVLLM
from proxy.config import ProxySettings
from tests.conftest import RunningProxy

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2}


def publish(
    sessions: Sessions,
    fake: FakeVLLM,
    tmp_path: Path,
    lineage: str,
    *,
    canary_rule: canary.Rule | None = None,
) -> int:
    """A new version of `lineage`, loaded into the fake first (as the trainer does); with
    `canary_rule`, as the lineage's canary candidate."""
    with sessions.begin() as session:
        version = policy.next_version(session=session)
        parent = policy.current(session=session, lineage=lineage)
    path = tmp_path / naming.adapter_name(lineage, version)
    path.mkdir()
    fake.loras[path.name] = str(path)
    with sessions.begin() as session:
        policy.publish(
            session=session,
            lineage=lineage,
            parent=parent.version if parent else None,
            version=version,
            path=str(path),
            base_model="demo",
            stats={},
            trained_transitions=1,
            canary_rule=canary_rule,
        )
    return version


def served(proxy: RunningProxy, agent: str | None) -> tuple[str, str, str]:
    """(X-Policy-Version, X-Policy-Lineage, the model vLLM was asked for) for one call."""
    headers = {"X-Agent-Name": agent} if agent else {}
    with proxy.client(**headers) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    return r.headers["x-policy-version"], r.headers["x-policy-lineage"], r.json()["model"]


def wait_for(proxy: RunningProxy, agent: str, version: str) -> None:
    deadline = time.monotonic() + 5
    while served(proxy, agent)[0] != version:
        assert time.monotonic() < deadline, f"{agent} never got v{version}"
        time.sleep(0.05)


@pytest.mark.slow
def test_policy_is_served_by_the_calling_agents_own_lineage(
    make_proxy: Any, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> None:
    proxy = make_proxy(adapter_per_agent="writer,rewriter", admin_key="root")
    writer = publish(sessions, fake_vllm, tmp_path, "writer")
    rewriter = publish(sessions, fake_vllm, tmp_path, "rewriter")
    wait_for(proxy, "rewriter", str(rewriter))
    assert served(proxy, "writer") == (str(writer), "writer", f"writer-v{writer}")
    assert served(proxy, "rewriter") == (str(rewriter), "rewriter", f"rewriter-v{rewriter}")
    # Not given a lineage (the checker), unknown, or untagged: the default lineage, which no
    # trainer trains here, so the base model. Never an error.
    for agent in ("checker", "somebody-else", None):
        assert served(proxy, agent) == ("0", "policy", "demo")

    # The writer's next version moves the writer only; its rollback leaves the rewriter.
    newer = publish(sessions, fake_vllm, tmp_path, "writer")
    wait_for(proxy, "writer", str(newer))
    admin = proxy.client(Authorization="Bearer root")
    r = admin.post(f"/admin/adapters/{writer}/activate")
    assert r.status_code == 200 and r.json()["lineage"] == "writer", r.text
    assert served(proxy, "writer")[0] == str(writer)
    assert served(proxy, "rewriter")[0] == str(rewriter)
    r = admin.post("/admin/adapters/0/activate?lineage=rewriter")  # back on the base model
    assert r.status_code == 200 and r.json() == {
        "version": 0,
        "lineage": "rewriter",
        "name": None,
        "is_current": True,
    }
    assert served(proxy, "rewriter") == ("0", "rewriter", "demo")
    assert served(proxy, "writer")[0] == str(writer)
    assert admin.post("/admin/adapters/0/activate?lineage=a/b").status_code == 400
    listed = admin.get("/admin/adapters?lineage=writer").json()["data"]
    assert [(a["name"], a["is_current"]) for a in listed] == [
        (f"writer-v{writer}", True),
        (f"writer-v{newer}", False),
    ]

    # Each recorded transition names the lineage that served it, which is what a trainer claims.
    rows = proxy.wait_rows(
        "SELECT agent_name, lineage, policy_version FROM transition "
        "WHERE agent_name IN ('checker', 'writer') ORDER BY requested_at",
        expected=6,
    )
    assert ("checker", "policy", 0) in rows and ("writer", "writer", writer) in rows
    health = proxy.client().get("/healthz").json()
    assert health["lineages"] == {"writer": writer} and health["policy_version"] == 0


def test_a_pinned_version_is_served_as_its_own_lineage(
    make_proxy: Any, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> None:
    proxy = make_proxy(adapter_per_agent="writer")
    writer = publish(sessions, fake_vllm, tmp_path, "writer")
    with proxy.client(**{"X-Agent-Name": "checker"}) as c:
        r = c.post("/v1/chat/completions", json=CHAT | {"model": f"policy@{writer}"})
    assert r.status_code == 200, r.text
    assert (r.headers["x-policy-version"], r.headers["x-policy-lineage"]) == (str(writer), "writer")
    with proxy.client() as c:  # a model that is not the policy: no lineage
        r = c.post("/v1/chat/completions", json=CHAT | {"model": "demo-other"})
    assert r.headers["x-policy-lineage"] == "none"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("writer=a+a", "agent 'a' is given two lineages"),
        ("w=a,v=a", "agent 'a' is given two lineages"),
        ("a/b", "is not an agent name"),
        ("sql/x=writer", "is not a lineage name"),
        ("=writer", "is not a lineage name"),
    ],
)
def test_bad_lineage_settings_fail_at_start_naming_the_problem(value: str, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ProxySettings(adapter_per_agent=value)


def test_lineage_settings_name_groups_or_one_per_agent() -> None:
    assert ProxySettings(adapter_per_agent="sql=writer+rewriter, judge").adapter_per_agent == {
        "writer": "sql",
        "rewriter": "sql",
        "judge": "judge",
    }
