"""Lineages belong to tenants (issue 33): a tenant's `policy` is its own line of versions, it
cannot name another tenant's version or adapter (404, as if there were none), it does not see
them listed, and a canary's evidence is only what the split assigned, of the lineage's tenant.
Real Postgres, the fake vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from core import canary, naming
from core.database import Sessions
from demo.tiny_model import build_demo_model
from fakes.vllm import FakeVLLM
from proxy.config import ProxySettings
from tests.conftest import TEST_HOME, RunningProxy
from tests.core.test_lineages import publish
from tests.core.test_tenants import as_, new_key
from trainer.config import TrainerSettings

DEFAULT_KEY = "sk-the-default-tenant"  # FLYWHEEL_API_KEYS: the default tenant's
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2}


def call(proxy: RunningProxy, key: str, model: str = "policy", **headers: str) -> Any:
    with proxy.client(**as_(key, **headers)) as c:
        return c.post("/v1/chat/completions", json={**CHAT, "model": model})


@pytest.fixture
def keyed(make_proxy: Any) -> RunningProxy:
    return make_proxy(
        auth="keys",
        keys_refresh_s=0.1,
        adapter_per_agent="writer",
        api_keys=DEFAULT_KEY,
        metrics_key="sk-metrics",
    )  # type: ignore[no-any-return]


def test_each_tenant_is_served_its_own_lineage(
    keyed: RunningProxy, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    acme, globex = new_key(sessions, "acme"), new_key(sessions, "globex")
    keyed.wait_keys(acme, globex)
    mine = publish(sessions, fake_vllm, tmp_path, "acme.policy")
    writer = publish(sessions, fake_vllm, tmp_path, "acme.writer")
    keyed.wait_policy(writer, "acme.writer")

    r = call(keyed, acme)
    assert (r.headers["x-policy-lineage"], r.json()["model"]) == (
        "acme.policy",
        f"acme.policy-v{mine}",
    )
    r = call(keyed, acme, **{"X-Agent-Name": "writer"})
    assert r.headers["x-policy-lineage"] == "acme.writer"
    assert r.headers["x-policy-version"] == str(writer)
    # globex and the default tenant: lineages of their own, with no versions yet (the base model)
    for key, lineage in ((globex, "globex.policy"), (DEFAULT_KEY, "policy")):
        r = call(keyed, key)
        assert r.status_code == 200, r.text
        assert (r.headers["x-policy-lineage"], r.headers["x-policy-version"]) == (lineage, "0")
    r = call(keyed, globex, **{"X-Agent-Name": "writer"})  # the same role, globex's own line
    assert (r.headers["x-policy-lineage"], r.headers["x-policy-version"]) == ("globex.writer", "0")
    keyed.wait_rows("SELECT 1 FROM transition WHERE starts_with(episode_id, 'globex/')", 2)
    lineages = "SELECT DISTINCT lineage FROM transition WHERE starts_with(episode_id, %s)"
    assert sorted(keyed.query(lineages, "globex/")) == [("globex.policy",), ("globex.writer",)]


def test_another_tenants_version_is_not_found_however_it_is_named(
    keyed: RunningProxy, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    acme, globex = new_key(sessions, "acme"), new_key(sessions, "globex")
    keyed.wait_keys(acme, globex)
    version = publish(sessions, fake_vllm, tmp_path, "acme.policy")
    name = naming.adapter_name("acme.policy", version)
    keyed.wait_policy(version, "acme.policy")

    for model in (f"policy@{version}", name):
        assert call(keyed, acme, model).status_code == 200
        refused = call(keyed, globex, model)
        assert refused.status_code == 404, refused.text
        absent = call(keyed, globex, "policy@999999" if "@" in model else "acme.policy-v999999")
        assert refused.json() == {
            **absent.json(),
            "error": {**absent.json()["error"], "message": refused.json()["error"]["message"]},
        }
        assert refused.json()["error"]["code"] == "model_not_found"
        assert "acme" not in refused.json()["error"]["message"].replace(name, "")
    assert call(keyed, DEFAULT_KEY, name).status_code == 404  # a tenant like the others
    asked = [r["body"]["model"] for r in fake_vllm.requests if r["path"].endswith("/completions")]
    assert asked.count(name) == 2  # acme's two calls; none of the refused ones reached vLLM

    listed = {
        key: {m["id"] for m in keyed.client(**as_(key)).get("/v1/models").json()["data"]}
        for key in (acme, globex)
    }
    assert name in listed[acme] and name not in listed[globex]
    assert "policy" in listed[globex]


def test_a_tenant_opted_into_the_shared_lineages_is_served_and_trains_them(
    make_proxy: Any, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    proxy = make_proxy(
        auth="keys", keys_refresh_s=0.1, shared_lineages="acme", metrics_key="sk-metrics"
    )
    acme, globex = new_key(sessions, "acme"), new_key(sessions, "globex")
    proxy.wait_keys(acme, globex)
    shared = publish(sessions, fake_vllm, tmp_path, "policy")
    proxy.wait_policy(shared)
    assert call(proxy, acme).headers["x-policy-lineage"] == "policy"
    assert call(proxy, acme, f"policy@{shared}").status_code == 200
    assert call(proxy, globex).headers["x-policy-lineage"] == "globex.policy"
    assert call(proxy, globex, f"policy@{shared}").status_code == 404


@pytest.mark.parametrize(
    ("shared", "error"),
    [("acme,ACME", "'ACME' is not a tenant name"), ("a.b", "'a.b' is not a tenant name")],
)
def test_bad_shared_lineage_settings_fail_at_start(shared: str, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ProxySettings(shared_lineages=shared)


def test_lineage_names_keep_tenant_and_role_apart() -> None:
    assert naming.check_lineage("acme.writer") == "acme.writer"
    for bad in ("a.b.c", "Acme.policy", ".policy", "acme."):
        with pytest.raises(ValueError, match="not a lineage name"):
            naming.check_lineage(bad)
    with pytest.raises(ValidationError, match="not a lineage name"):
        ProxySettings(adapter_per_agent="acme.writer=sql")  # the proxy adds the tenant itself
    assert naming.tenant_of_lineage("acme.writer") == "acme"
    assert naming.tenant_of_lineage("writer") is None
    assert naming.sees("acme", "acme.writer", shared=False)
    assert not naming.sees("acme", "writer", shared=False)
    assert naming.sees("acme", "writer", shared=True)
    assert not naming.sees(None, "acme.writer", shared=True)
    assert not naming.sees("globex", "acme.writer", shared=True)


@pytest.mark.slow
def test_canary_evidence_is_what_the_split_assigned_of_the_lineages_tenant(
    keyed: RunningProxy, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    acme = new_key(sessions, "acme")
    keyed.wait_keys(acme)
    baseline = publish(sessions, fake_vllm, tmp_path, "acme.policy")
    rule = canary.Rule(fraction=0.5, min_episodes=1)
    candidate = publish(sessions, fake_vllm, tmp_path, "acme.policy", canary_rule=rule)
    keyed.wait_policy(candidate, "acme.policy", canary=True)
    episodes = [f"e{i}" for i in range(40)]
    assigned = {e for e in episodes if canary.in_canary(f"acme/{e}", candidate, 0.5)}
    assert 0 < len(assigned) < len(episodes)
    for e in episodes:  # each episode asks for the candidate by name: the split is bypassed
        r = call(keyed, acme, f"policy@{candidate}", **{"X-Episode-Id": e})
        assert r.status_code == 200, r.text
        ok = keyed.client(**as_(acme)).post("/v1/rewards", json={"episode_id": e, "reward": 1.0})
        assert ok.status_code == 200, ok.text
    with sessions.begin() as session:
        test = canary.opened(session=session)["acme.policy"]
        cand, base = canary.evidence_rows(test, session=session)
    # Only the episodes the hash would have sent to the candidate anyway count.
    assert len(cand) == len(assigned) and base == []
    assert baseline != candidate


def test_a_tenants_lineage_is_trained_on_that_tenants_calls_only(tmp_path: Path) -> None:
    model = build_demo_model(TEST_HOME / "models" / "demo")
    base = {"model": model, "vllm": ["http://127.0.0.1:9"], "adapters_dir": tmp_path}
    assert TrainerSettings(**base, lineage="acme.policy").tenants == ["acme"]
    assert TrainerSettings(**base, lineage="policy", tenants="acme").tenants == ["acme"]
    with pytest.raises(ValidationError, match="tenant 'acme''s: it trains on that tenant's"):
        TrainerSettings(**base, lineage="acme.policy", tenants="globex")
