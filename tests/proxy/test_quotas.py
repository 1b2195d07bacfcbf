"""Per-tenant quotas (issue 33, proxy/quotas.py): completion calls per second and in flight,
reward posts and reads per second; over one, a 429 with Retry-After and nothing recorded, and
another tenant is not held back. A real proxy on the fake vLLM and real Postgres, tenants' keys
made as `flywheel keys create` makes them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from core import tenants
from core.database import Sessions
from fakes.vllm import FakeVLLM
from proxy.config import ProxySettings
from proxy.relay import wire
from tests.conftest import RunningProxy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# A call each completion route answers (tests/proxy/test_openapi.py VALID).
BODIES = {
    wire.CHAT.path: CHAT,
    wire.COMPLETIONS.path: {"model": "demo", "prompt": "hi", "max_tokens": 2},
    wire.RESPONSES.path: {"model": "demo", "input": "hi", "max_output_tokens": 2},
    wire.MESSAGES.path: CHAT,
}
SLOW = 5.0  # a rate slow enough (one request per SLOW s) that no token comes back mid-test
ADMIN = "admin-quota-test"


def keys(sessions: Sessions, *names: str) -> list[str]:
    with sessions.begin() as session:
        made = [
            tenants.create_key(session=session, tenant=n, scopes=list(tenants.SCOPES))
            for n in names
        ]
    return [key for _, key in made]


def client(proxy: RunningProxy, key: str, **headers: str) -> httpx.Client:
    return proxy.client(Authorization=f"Bearer {key}", **headers)


def refused(answer: httpx.Response, *, anthropic: bool = False) -> str:
    """The 429's message, once its shape and Retry-After are checked."""
    assert answer.status_code == 429, answer.text
    assert 1 <= int(answer.headers["retry-after"]) <= SLOW, answer.headers
    body = answer.json()
    if anthropic:
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
        return str(body["error"]["message"])
    error = body["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded", body
    return str(error["message"])


def refusals(proxy: RunningProxy, tenant: str, limit: str) -> float:
    """flywheel_quota_refusals_total{tenant, limit} as /metrics says it (0 before the first)."""
    text = httpx.get(proxy.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    line = f'flywheel_quota_refusals_total{{limit="{limit}",tenant="{tenant}"}} '
    found = re.search(re.escape(line) + r"(\S+)", text)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def keyed(make_proxy: Any) -> Any:
    def make(**quotas: Any) -> RunningProxy:
        proxy: RunningProxy = make_proxy(
            auth="keys", keys_refresh_s=0.1, admin_key=ADMIN, api_keys=["sk-default"], **quotas
        )
        return proxy

    return make


def test_over_its_rate_a_tenant_gets_429_with_retry_after_and_others_go_on(
    keyed: Any, sessions: Sessions, fake_vllm: FakeVLLM
) -> None:
    """FLYWHEEL_QUOTA_RPS for every tenant (the default one too), a tenant's own over it."""
    acme, globex = keys(sessions, "acme", "globex")
    proxy = keyed(quota_rps=1 / SLOW, tenant_quotas={"globex": {"rps": 0}})  # 0: no limit
    proxy.wait_keys(acme, globex)
    before = refusals(proxy, "acme", "rps")
    with client(proxy, acme, **{"X-Episode-Id": "e1"}) as a:
        assert a.post("/v1/chat/completions", json=CHAT).status_code == 200  # its burst: 1
        sent = len(fake_vllm.requests)
        message = refused(a.post("/v1/chat/completions", json=CHAT))
    assert "'acme'" in message and "FLYWHEEL_QUOTA_RPS" in message, message
    assert len(fake_vllm.requests) == sent  # not forwarded...
    assert refusals(proxy, "acme", "rps") == before + 1
    with client(proxy, globex) as g:  # ...and another tenant is not held back
        for _ in range(5):
            assert g.post("/v1/chat/completions", json=CHAT).status_code == 200
    with client(proxy, "sk-default") as d:  # FLYWHEEL_API_KEYS' tenant: `default`
        assert d.post("/v1/chat/completions", json=CHAT).status_code == 200
        refused(d.post("/v1/chat/completions", json=CHAT))
    # ...nor recorded: acme's one call, globex's five, the default tenant's one.
    rows = proxy.wait_rows("SELECT episode_id FROM transition", 7)
    assert len(rows) == 7 and sum(e.startswith("acme/") for (e,) in rows) == 1, rows


def test_every_completion_route_refuses_in_its_own_shape(keyed: Any, sessions: Sessions) -> None:
    (acme,) = keys(sessions, "acme")
    proxy = keyed(tenant_quotas="acme:rps=0.2")
    proxy.wait_keys(acme)
    with client(proxy, acme) as a:
        assert a.post("/v1/completions", json=BODIES[wire.COMPLETIONS.path]).status_code == 200
        for path, body in BODIES.items():
            refused(a.post(path, json=body), anthropic=path == wire.MESSAGES.path)
        # The path form of the base URL, and Anthropic's key header.
        path_form = "/episode/e2" + wire.MESSAGES.path
        answer = proxy.client(**{"x-api-key": acme}).post(path_form, json=CHAT)
        refused(answer, anthropic=True)


# Seeds the fake samples a 24-token and a 3-token answer for CHAT with (fakes/engine.py).
LONG, SHORT = 3, 8


class Stream:
    """A stream opened and under way (its first event read): it holds a slot until it ends."""

    def __init__(self, c: httpx.Client, seed: int) -> None:
        body = {**CHAT, "stream": True, "max_tokens": 30, "seed": seed}
        self._opened = c.stream("POST", "/v1/chat/completions", json=body)
        response = self._opened.__enter__()
        assert response.status_code == 200, response.read()
        self._events = response.iter_raw()
        next(self._events)

    def read_to_the_end(self) -> None:
        for _ in self._events:
            pass
        self.leave()

    def leave(self) -> None:
        """Close it (under way: the client's connection goes)."""
        self._opened.__exit__(None, None, None)


def accepted_soon(proxy: RunningProxy, c: httpx.Client) -> None:
    """A call is let through within a few seconds (once the proxy has seen a stream end)."""

    def goes() -> bool:
        answer = c.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code in (200, 429), answer.text
        return answer.status_code == 200

    proxy.wait_until(goes, "a free slot", timeout=5)


@pytest.mark.slow
def test_concurrent_calls_are_limited_and_a_slot_frees_however_the_call_ends(
    keyed: Any, sessions: Sessions, fake_vllm: FakeVLLM
) -> None:
    fake_vllm.token_delay_s = 1.0  # a SHORT stream takes ~4 s, a LONG one ~25 s
    acme, globex = keys(sessions, "acme", "globex")
    proxy = keyed(tenant_quotas="acme:concurrency=2")
    proxy.wait_keys(acme, globex)
    before = refusals(proxy, "acme", "concurrency")
    with client(proxy, acme) as a, client(proxy, globex) as g:
        short, held = Stream(a, SHORT), Stream(a, LONG)
        message = refused(a.post("/v1/chat/completions", json=CHAT))
        assert "in flight" in message and "FLYWHEEL_QUOTA_CONCURRENCY" in message, message
        assert refusals(proxy, "acme", "concurrency") == before + 1
        others = [Stream(g, LONG) for _ in range(3)]  # globex has no limit
        # A stream read to its end frees its slot...
        short.read_to_the_end()
        accepted_soon(proxy, a)
        # ...as does the client leaving mid-stream...
        left = Stream(a, LONG)
        refused(a.post("/v1/chat/completions", json=CHAT))
        left.leave()
        accepted_soon(proxy, a)
        # ...and an upstream error (with a slot leaked, `held` and it would fill the quota).
        fake_vllm.fail_next(1, 500)
        assert a.post("/v1/chat/completions", json=CHAT).status_code == 500
        accepted_soon(proxy, a)
        for stream in [held, *others]:
            stream.leave()


def test_reward_posts_and_reads_have_their_own_rates(keyed: Any, sessions: Sessions) -> None:
    acme, globex = keys(sessions, "acme", "globex")
    proxy = keyed(quota_rewards_rps=1 / SLOW, quota_reads_rps=1 / SLOW)
    proxy.wait_keys(acme, globex)
    with client(proxy, acme, **{"X-Episode-Id": "e1"}) as a:
        for _ in range(3):  # calls are not limited: only rewards and reads are
            assert a.post("/v1/chat/completions", json=CHAT).status_code == 200
        reward = {"episode_id": "e1", "reward": 1.0}
        assert a.post("/v1/rewards", json=reward).status_code == 200
        message = refused(a.post("/v1/rewards", json={**reward, "reward": 0.5}))
        assert "reward posts" in message and "FLYWHEEL_QUOTA_REWARDS_RPS" in message, message
        assert proxy.query("SELECT value FROM reward") == [(1.0,)]  # the refused one: not stored

        assert a.get("/v1/episodes/e1").status_code == 200
        for read in ("/v1/episodes/e1", "/v1/export", "/ui/api/overview", "/ui/api/episodes"):
            assert "reads per second" in refused(a.get(read)), read
    with client(proxy, globex) as g:
        assert g.post("/v1/rewards", json={"episode_id": "e9", "reward": 1.0}).status_code in (
            200,
            202,
        )
        assert g.get("/ui/api/overview").status_code == 200
    with client(proxy, ADMIN) as operator:  # every tenant's dashboard: no tenant's quota
        for _ in range(3):
            assert operator.get("/ui/api/overview").status_code == 200


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("acme:rps", "is not tenant:limit=value"),
        ("acme", "is not tenant:limit=value"),
        ("acme:speed=3", "no limit is called 'speed' \\(the limits: rps, concurrency"),
        ("acme:rps=fast", "valid number"),
        ("acme:rps=-1", "greater than or equal to 0"),
        ("acme:concurrency=1.5", "valid integer"),
        ("Acme:rps=1", "'Acme' is not a tenant name"),
        ("acme:rps=1;acme:rps=2", "tenant 'acme' is given quotas twice"),
        ('{"acme": 5', "not valid JSON"),
    ],
)
def test_malformed_quotas_are_refused_naming_what_is_wrong(value: str, why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        ProxySettings(tenant_quotas=value)


def test_the_proxy_will_not_start_with_malformed_quotas() -> None:
    env = {
        **os.environ,
        "FLYWHEEL_TENANT_QUOTAS": "acme:rps=5;beta:rps",
        "FLYWHEEL_QUOTA_RPS": "-2",
    }
    run = subprocess.run(
        [sys.executable, "-m", "flywheel", "proxy", "--upstream", "http://127.0.0.1:9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "bad settings" in run.stderr and "quota_rps" in run.stderr, run.stderr
    assert "'beta:rps' is not tenant:limit=value" in run.stderr, run.stderr


def test_json_quotas_and_defaults_under_a_tenants_own() -> None:
    settings = ProxySettings(
        quota_rps=10, quota_concurrency=4, tenant_quotas='{"acme": {"concurrency": 1}}'
    )
    assert settings.tenant_quotas["acme"].concurrency == 1
    assert settings.tenant_quotas["acme"].model_fields_set == {"concurrency"}  # rps: the default's


def test_a_quota_holds_across_replicas_each_granting_its_share(
    keyed: Any, sessions: Sessions
) -> None:
    """Quotas were per process: N replicas granted a tenant N times its quota. Each proxy beats a
    heartbeat into Postgres now and grants 1/N of every limit, N being the replicas alive; one
    that stops gives its share back to the others."""
    (acme,) = keys(sessions, "acme")
    quota = {"tenant_quotas": "acme:rps=4", "quota_burst_s": 1.0, "quota_heartbeat_s": 0.2}
    one, two = keyed(**quota), keyed(**quota)
    for proxy in (one, two):
        proxy.wait_keys(acme)
        assert proxy.services.quotas is not None
        proxy.wait_until(lambda p=proxy: p.services.quotas.replicas == 2, "both proxies counted")
    answers = []
    for proxy in (one, two):  # a burst at each: 4 at once in all (2 each), not 4 each
        with client(proxy, acme) as c:
            answers += [c.post("/v1/chat/completions", json=CHAT) for _ in range(4)]
    admitted = sum(a.status_code == 200 for a in answers)
    assert 4 <= admitted <= 5, [a.status_code for a in answers]  # (+1: refilled meanwhile)
    message = refused(next(a for a in answers if a.status_code == 429))
    assert "shared by 2 proxies" in message, message
    one.stop()  # it leaves: the other grants the whole quota again
    two.wait_until(lambda: two.services.quotas.replicas == 1, "one proxy left")  # type: ignore[union-attr]
    assert proxy.query("SELECT count(*) FROM proxy_replica") == [(1,)]
