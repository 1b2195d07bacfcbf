"""Tenants, keys and exposure (issue 13, items 9 and 10): hashed scoped keys, ownership, the CLI,
and a proxy that will not serve the network without keys."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import text

from core import tenants
from core.database import Sessions
from fakes.vllm import FakeVLLM
from proxy.config import ProxySettings
from tests.conftest import RunningProxy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


# --- item 9: no open proxy on the network by accident -----------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "proxy.internal"])
def test_a_network_address_without_keys_is_refused_naming_the_ways_out(host: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ProxySettings(host=host, upstream=["http://127.0.0.1:1"])
    message = str(refused.value)
    assert "without API keys" in message and "FLYWHEEL_DANGEROUSLY_SERVE_WITHOUT_KEYS" in message
    # Each way out is accepted.
    ProxySettings(host=host, upstream=["http://127.0.0.1:1"], api_keys=["k"])
    ProxySettings(host=host, upstream=["http://127.0.0.1:1"], auth="keys")
    ProxySettings(host=host, upstream=["http://127.0.0.1:1"], dangerously_serve_without_keys=True)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_keys(host: str) -> None:
    assert not ProxySettings(host=host, upstream=["http://127.0.0.1:1"]).auth_on


# --- item 10: tenants ----------------------------------------------------------------------------


def new_key(sessions: Sessions, tenant: str, scopes: str = "infer,reward,read") -> str:
    with sessions.begin() as session:
        return tenants.create_key(session=session, tenant=tenant, scopes=scopes.split(","))[1]


def as_(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


@pytest.fixture
def keyed(make_proxy: Any) -> RunningProxy:
    return make_proxy(auth="keys", keys_refresh_s=0.1)  # type: ignore[no-any-return]


def test_a_tenants_episodes_are_its_own(keyed: RunningProxy, sessions: Sessions) -> None:
    acme, globex = new_key(sessions, "acme"), new_key(sessions, "globex")
    keyed.wait_keys(acme, globex)  # made after the proxy started
    with keyed.client(**as_(acme, **{"X-Episode-Id": "e1", "X-Task-Id": "t1"})) as c:
        answer = c.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-episode-id"] == "e1"  # the client's own name for it
    tid = answer.headers["x-transition-id"]
    keyed.wait_rows("SELECT 1 FROM transition WHERE id = %s", 1, tid)
    assert keyed.query("SELECT episode_id, task_id FROM transition") == [("acme/e1", "acme/t1")]

    mine = keyed.client(**as_(acme)).get("/v1/episodes/e1")
    assert mine.status_code == 200, mine.text
    assert mine.json()["id"] == "e1" and mine.json()["task_id"] == "t1"
    assert mine.json()["transitions"][0]["task_id"] == "t1"

    other = keyed.client(**as_(globex))
    assert other.get("/v1/episodes/e1").status_code == 404
    step = other.post("/v1/rewards", json={"episode_id": "e1", "transition_id": tid, "reward": 9})
    assert step.status_code == 404 and step.json()["error"]["code"] == "transition_not_found"
    # A final reward for "e1" is globex's own e1: acme's episode is untouched.
    final = other.post("/v1/rewards", json={"episode_id": "e1", "reward": 9.0})
    assert final.status_code == 200 and final.json()["episode_id"] == "e1"
    assert keyed.query("SELECT id, final_reward FROM episode ORDER BY id") == [
        ("acme/e1", None),
        ("globex/e1", 9.0),
    ]
    mine = keyed.client(**as_(acme)).post("/v1/rewards", json={"episode_id": "e1", "reward": 1.0})
    assert mine.json()["credited_transitions"] == 1
    assert keyed.query('SELECT "return" FROM transition') == [(1.0,)]


def test_scopes_limit_what_a_key_may_do(keyed: RunningProxy, sessions: Sessions) -> None:
    infer, reader = new_key(sessions, "acme", "infer"), new_key(sessions, "acme", "read")
    keyed.wait_keys(infer, reader)
    with keyed.client(**as_(infer, **{"X-Episode-Id": "s1"})) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert c.get("/v1/models").status_code == 200
        refused = c.post("/v1/rewards", json={"episode_id": "s1", "reward": 1.0})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "insufficient_scope"
        assert c.get("/v1/episodes/s1").status_code == 403
    with keyed.client(**as_(reader)) as c:
        assert c.get("/v1/episodes/s1").status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 403
    assert keyed.query("SELECT count(*) FROM reward") == [(0,)]


def test_keys_are_stored_hashed_and_a_revoked_key_stops_working(
    keyed: RunningProxy, sessions: Sessions
) -> None:
    key = new_key(sessions, "acme")
    keyed.wait_keys(key)
    assert keyed.client(**as_(key)).get("/v1/models").status_code == 200
    rows = keyed.query("SELECT * FROM api_key")
    assert rows and not any(key in str(value) for row in rows for value in row)
    kid = tenants.key_id(key)
    assert kid is not None
    for bad in (key[:-1] + ("A" if key[-1] != "A" else "B"), f"fw_{kid}_", "x", key.upper()):
        r = keyed.client(**as_(bad)).get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", bad
    with sessions.begin() as session:
        assert tenants.revoke_key(kid, session=session)
    deadline = time.monotonic() + 5
    while keyed.client(**as_(key)).get("/v1/models").status_code != 401:
        assert time.monotonic() < deadline, "the revoked key still works"
        time.sleep(0.05)


def test_env_keys_are_the_default_tenant_alongside_tenant_keys(
    make_proxy: Any, sessions: Sessions
) -> None:
    proxy = make_proxy(api_keys=["sk-env"], keys_refresh_s=0.1)
    acme = new_key(sessions, "acme")
    proxy.wait_keys(acme)
    with proxy.client(**as_("sk-env", **{"X-Episode-Id": "d1"})) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    with proxy.client(**as_(acme, **{"X-Episode-Id": "d1"})) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    proxy.wait_rows("SELECT 1 FROM transition", 2)
    assert sorted(proxy.query("SELECT episode_id FROM transition")) == [("acme/d1",), ("d1",)]
    assert proxy.client().get("/openapi.json").status_code == 404


def test_a_default_tenant_key_reads_no_other_tenants_episode_by_its_stored_id(
    make_proxy: Any, sessions: Sessions
) -> None:
    """Issue 33, finding 1: `acme/e1` is how acme's e1 is stored; a FLYWHEEL_API_KEYS key (the
    default tenant's: ids stored as given) naming it must find nothing, as the list does."""
    proxy = make_proxy(api_keys=["sk-env"], keys_refresh_s=0.1)
    acme = new_key(sessions, "acme")
    proxy.wait_keys(acme)
    made = {}
    for key in (acme, "sk-env"):
        with proxy.client(**as_(key, **{"X-Episode-Id": "e1"})) as c:
            answer = c.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
        made[key] = answer.headers["x-transition-id"]
    theirs, ours = made[acme], made["sk-env"]
    proxy.wait_rows("SELECT 1 FROM transition", 2)

    default = proxy.client(**as_("sk-env"))
    for path in (
        "/ui/api/episodes/acme/e1",
        "/ui/api/episodes/acme/e1?tokens=true",
        "/ui/api/episodes/acme%2Fe1",
        "/v1/episodes/acme%2Fe1",
        f"/ui/api/transitions/{theirs}/tokens",
    ):
        r = default.get(path)
        assert r.status_code == 404, (path, r.text)
    assert [e["id"] for e in default.get("/ui/api/episodes").json()["data"]] == ["e1"]
    # Its own e1 (stored as `e1`) it reads; acme reads only its own.
    assert default.get("/ui/api/episodes/e1").json()["transitions"][0]["id"] == ours
    assert default.get("/v1/episodes/e1").json()["transitions"][0]["id"] == ours
    assert default.get(f"/ui/api/transitions/{ours}/tokens").status_code == 200
    mine = proxy.client(**as_(acme)).get("/ui/api/episodes/e1").json()
    assert mine["id"] == "e1" and mine["transitions"][0]["id"] == theirs
    assert proxy.client(**as_(acme)).get(f"/ui/api/transitions/{ours}/tokens").status_code == 404


def test_a_tenants_adapters_are_not_listed_to_other_tenants(
    make_proxy: Any, sessions: Sessions, fake_vllm: FakeVLLM
) -> None:
    """vLLM lists every adapter it has loaded, named after its lineage: another tenant's
    (`globex.policy-v3`) is not in a tenant's /v1/models, nor the default tenant's (shared) ones
    unless it opted into them (FLYWHEEL_SHARED_LINEAGES)."""
    proxy = make_proxy(api_keys=["sk-env"], keys_refresh_s=0.1)
    acme = new_key(sessions, "acme")
    proxy.wait_keys(acme)
    for name in ("policy-v1", "acme.policy-v2", "globex.policy-v3"):
        fake_vllm.loras[name] = f"/adapters/{name}"

    def listed(key: str) -> list[str]:
        return [m["id"] for m in proxy.client(**as_(key)).get("/v1/models").json()["data"]]

    assert listed("sk-env") == ["demo", "policy-v1", "policy"]
    assert listed(acme) == ["demo", "acme.policy-v2", "policy"]


def test_ownership_is_the_same_rule_in_python_and_in_sql(sessions: Sessions) -> None:
    """`owns_episode` (an id a caller names) and `owns_episode_sql` (the lists) agree."""
    ids = ["e1", "acme", "acme/e1", "acme/a/b", "acmex/e1", "globex/e1"]
    acme = tenants.Principal("acme", frozenset(tenants.SCOPES))
    for principal in (tenants.DEFAULT, tenants.OPERATOR, acme):
        condition, params = principal.owns_episode_sql("id")
        with sessions.begin() as session:
            seen = session.scalars(
                text(f"SELECT id FROM unnest(CAST(:ids AS text[])) AS id WHERE {condition}"),
                params | {"ids": ids},
            )
            assert set(seen) == {i for i in ids if principal.owns_episode(i)}, principal
    assert [i for i in ids if acme.owns_episode(i)] == ["acme/e1", "acme/a/b"]


@pytest.mark.slow
def test_the_keys_cli_creates_lists_and_revokes(database_url: str) -> None:
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": database_url}

    def flywheel(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flywheel", "keys", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    created = flywheel("create", "--tenant", "acme", "--scopes", "infer,reward", "--name", "ci")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    kid = tenants.key_id(key)
    assert kid and "shown once" in created.stderr
    listed = flywheel("list")
    assert kid in listed.stdout and "acme" in listed.stdout and "infer,reward" in listed.stdout
    assert key not in listed.stdout
    assert flywheel("revoke", kid).returncode == 0
    assert "revoked" in flywheel("list").stdout
    again = flywheel("revoke", kid)
    assert again.returncode != 0 and "no active key" in again.stderr
    bad = flywheel("create", "--tenant", "Acme/../x")
    assert bad.returncode != 0 and "tenant" in bad.stderr
    assert flywheel("create", "--tenant", "acme", "--scopes", "admin").returncode != 0
