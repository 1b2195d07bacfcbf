"""Bad input, auth, unknown routes, the policy alias: OpenAI-shaped errors, nothing stored."""

from __future__ import annotations

import time
from typing import Any

import orjson
import psycopg
import pytest

from fakes.vllm import FakeVLLM
from proxy.config import ProxySettings
from tests.conftest import RunningProxy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = {"Content-Type": "application/json"}


def assert_openai_error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error  # type: ignore[no-any-return]


def stored(proxy: RunningProxy) -> int:
    return int(proxy.query("SELECT count(*) FROM transition")[0][0])


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"", 400),
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'"a string"', 400),
        (b'{"messages": []}', 400),
        (b'{"model": 7, "messages": []}', 400),
        (b'{"model": "demo", "messages": [], "stream": "yes"}', 400),
        (b'{"model": "demo", "messages": [], "n": 0}', 400),
        (b'{"model": "demo", "messages": [], "n": "2"}', 400),
        (b'{"model": "demo", "messages": [], "n": 1000}', 400),
    ],
)
@pytest.mark.slow
def test_malformed_completion_requests_never_reach_vllm(
    proxy: RunningProxy, fake_vllm: FakeVLLM, raw: bytes, status: int
) -> None:
    r = proxy.client().post(
        "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    assert_openai_error(r, status)
    assert fake_vllm.requests == []
    assert stored(proxy) == 0


def test_vllm_validation_errors_pass_through(proxy: RunningProxy) -> None:
    r = proxy.client(**{"X-Episode-Id": "bad"}).post(
        "/v1/chat/completions", json={**CHAT, "temperature": "hot"}
    )
    assert r.status_code == 400
    assert "error" in r.json()
    rows = proxy.wait_rows("SELECT status, http_status FROM transition", 1)
    assert rows == [("failed", 400)]


def test_body_over_the_limit_is_413(make_proxy: Any, fake_vllm: FakeVLLM) -> None:
    proxy = make_proxy(max_body_bytes=4096)
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    error = assert_openai_error(proxy.client().post("/v1/chat/completions", json=huge), 413)
    assert error["code"] == "payload_too_large"
    # Without a Content-Length (chunked), the limit holds too.
    chunks = (b"x" * 1024 for _ in range(10))
    r = proxy.client().post("/v1/rewards", content=chunks, headers=JSON)
    assert_openai_error(r, 413)
    assert fake_vllm.requests == [] and stored(proxy) == 0


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/chat/completions", 404),
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/colour/red/v1/chat/completions", 404),
        ("POST", "/episode/v1/chat/completions", 404),
        ("GET", "/v1/episodes/unknown-episode", 404),
    ],
)
def test_unknown_routes_and_ids(proxy: RunningProxy, method: str, path: str, status: int) -> None:
    assert_openai_error(proxy.client().request(method, path, json=CHAT), status)


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Episode-Id": "has space"},
        {"X-Task-Id": ""},
        {"X-Agent-Name": "a" * 300},
        {"X-Episode-Id": "../../etc"},
    ],
)
def test_bad_tag_values_are_refused(proxy: RunningProxy, headers: dict[str, str]) -> None:
    error = assert_openai_error(
        proxy.client(**headers).post("/v1/chat/completions", json=CHAT), 400
    )
    assert error["code"] == "bad_tag"
    assert stored(proxy) == 0


@pytest.mark.parametrize(
    "prefix",
    [
        "/episode/e%0A",  # a trailing newline: `$` let it through, the response header refused it
        "/episode/e%250A",  # decoded twice it was a newline too
        "/task/t%2Fx",  # a slash inside a value
        "/agent/a%20b",
    ],
)
def test_path_tags_are_decoded_once_and_matched_whole(proxy: RunningProxy, prefix: str) -> None:
    r = proxy.client().post(f"{prefix}/v1/chat/completions", json=CHAT)
    error = assert_openai_error(r, 404 if "%2F" in prefix else 400)  # a slash splits the pairs
    assert "%2F" in prefix or error["code"] == "bad_tag"
    bad = proxy.client().post("/v1/rewards", json={"episode_id": "e\n", "reward": 1.0})
    assert_openai_error(bad, 400)
    assert stored(proxy) == 0
    ok = proxy.client().post("/episode/e%2B1/v1/chat/completions", json=CHAT)  # "e+1"
    assert ok.status_code == 200 and ok.headers["x-episode-id"] == "e+1"


def test_nothing_about_vllm_s_disk_or_address_reaches_clients(
    make_proxy: Any, fake_vllm: FakeVLLM
) -> None:
    fake_vllm.loras["policy-v1"] = "/var/lib/flywheel/adapters/policy-v1"
    proxy = make_proxy()
    models = proxy.client().get("/v1/models").json()["data"]
    assert {m["id"]: m["root"] for m in models} == {
        "demo": "demo",
        "policy-v1": "policy-v1",
        "policy": None,
    }
    assert proxy.client().get("/openapi.json").status_code == 200  # no keys: a local proxy
    dead = make_proxy(upstream=["http://127.0.0.1:9"], base_model="demo")
    r = dead.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502 and "127.0.0.1:9" not in r.text
    [(error,)] = dead.wait_rows("SELECT error::text FROM transition", 1)
    assert "127.0.0.1:9" in error  # the operator still sees where, in the record
    assert "127.0.0.1:9" not in dead.client().get("/v1/models").text


def test_api_keys_guard_v1_and_never_reach_vllm(make_proxy: Any, fake_vllm: FakeVLLM) -> None:
    proxy = make_proxy(api_keys="k1,k2", upstream_api_key="vllm-secret")
    assert_openai_error(proxy.client().post("/v1/chat/completions", json=CHAT), 401)
    bad = proxy.client(Authorization="Bearer nope").post("/v1/rewards", json={})
    assert assert_openai_error(bad, 401)["code"] == "invalid_api_key"
    assert proxy.client().get("/healthz").status_code == 200  # not under /v1
    assert proxy.client().get("/openapi.json").status_code == 404  # the schema is not public
    ok = proxy.client(Authorization="Bearer k2").post("/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200
    assert fake_vllm.requests[-1]["headers"]["Authorization"] == "Bearer vllm-secret"
    # The client's key is neither forwarded nor recorded.
    rows = proxy.wait_rows("SELECT params::text FROM transition", 1)
    assert "k2" not in rows[0][0]


def test_policy_alias_follows_the_current_adapter(proxy: RunningProxy, fake_vllm: FakeVLLM) -> None:
    def ask(model: str) -> Any:
        return proxy.client().post("/v1/chat/completions", json={**CHAT, "model": model})

    r = ask("policy")
    assert r.status_code == 200 and r.headers["x-policy-version"] == "0"
    assert fake_vllm.requests[-1]["body"]["model"] == "demo"

    fake_vllm.loras["policy-v1"] = "/adapters/policy-v1"
    with psycopg.connect(proxy.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO adapter_version (version, name, path, base_model, is_current) "
            "VALUES (1, 'policy-v1', '/adapters/policy-v1', 'demo', true)"
        )
    proxy.wait_rows("SELECT 1", 1)
    deadline = time.monotonic() + 5
    while ask("policy").headers["x-policy-version"] != "1" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake_vllm.requests[-1]["body"]["model"] == "policy-v1"
    pinned = ask("policy@0")
    assert pinned.headers["x-policy-version"] == "0"
    assert fake_vllm.requests[-1]["body"]["model"] == "demo"
    assert ask("policy@1").headers["x-policy-version"] == "1"
    assert assert_openai_error(ask("policy@7"), 404)["code"] == "model_not_found"
    assert_openai_error(ask("policy@latest"), 400)
    rows = proxy.wait_rows(
        "SELECT policy_version FROM transition WHERE model_used = 'policy-v1'", 2
    )
    assert {r[0] for r in rows} == {1}


@pytest.mark.parametrize("model", ["policy@\u00b2", "policy@\u0663", "policy@", "policy@-1"])
def test_a_pinned_version_that_is_not_an_ascii_number_is_a_400(
    proxy: RunningProxy, fake_vllm: FakeVLLM, model: str
) -> None:
    """'²' and '٣' pass str.isdigit(); int() refuses the first and reads the second as 3."""
    r = proxy.client().post("/v1/chat/completions", json={**CHAT, "model": model})
    assert assert_openai_error(r, 400)["code"] == "invalid_model"
    assert fake_vllm.requests == []


def test_a_version_beyond_any_adapter_is_a_404(proxy: RunningProxy) -> None:
    r = proxy.client().post("/v1/chat/completions", json={**CHAT, "model": "policy@" + "9" * 30})
    assert assert_openai_error(r, 404)["code"] == "model_not_found"


@pytest.mark.slow
def test_a_pinned_version_during_an_outage(
    own_postgres: Any, make_proxy: Any, fake_vllm: FakeVLLM
) -> None:
    """A version the proxy knows is served from its cache; one it must look up is a clear 503
    while Postgres is down, not a 500."""
    proxy: RunningProxy = make_proxy(database_url=own_postgres.url)
    fake_vllm.loras["policy-v1"] = "/adapters/policy-v1"
    with psycopg.connect(proxy.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO adapter_version (version, name, path, base_model, is_current) "
            "VALUES (1, 'policy-v1', '/adapters/policy-v1', 'demo', true)"
        )

    def ask(model: str) -> Any:
        return proxy.client().post("/v1/chat/completions", json={**CHAT, "model": model})

    deadline = time.monotonic() + 10
    while ask("policy").headers["x-policy-version"] != "1":  # the alias has seen it
        assert time.monotonic() < deadline
    own_postgres.stop()
    r = ask("policy@1")
    assert r.status_code == 200 and r.headers["x-policy-version"] == "1"
    error = assert_openai_error(ask("policy@2"), 503)
    assert error["code"] == "database_unavailable" and "policy@2" in error["message"]
    assert assert_openai_error(ask("policy@\u00b2"), 400)["code"] == "invalid_model"
    own_postgres.start()
    assert assert_openai_error(ask("policy@2"), 404)["code"] == "model_not_found"


def test_models_lists_the_alias(proxy: RunningProxy) -> None:
    ids = [m["id"] for m in proxy.client().get("/v1/models").json()["data"]]
    assert "demo" in ids and "policy" in ids


def test_metrics_and_health(proxy: RunningProxy) -> None:
    proxy.client().post("/v1/chat/completions", json=CHAT)
    proxy.wait_rows("SELECT 1 FROM transition", 1)
    text = proxy.client().get("/metrics").text
    for name in [
        'flywheel_requests_total{route="/v1/chat/completions",status="200"}',
        "flywheel_upstream_latency_seconds_bucket",
        "flywheel_proxy_overhead_seconds_bucket",
        'flywheel_transitions_recorded_total{status="ok"}',
        "flywheel_writer_queue_depth",
        "flywheel_transitions_journaled_total",
        "flywheel_rewards_ingested_total",
    ]:
        assert name in text, name
    assert proxy.client().get("/healthz").json()["database"] == "up"


def test_metrics_and_health_detail_need_the_metrics_or_admin_key(
    make_proxy: Any, fake_vllm: FakeVLLM
) -> None:
    """Issue 33, finding 3: /metrics and /healthz's detail name replica URLs, journal paths and
    every tenant's lineages. Keys on: the metrics or the admin key reads them; the probes (no
    key) still get /healthz's status and /livez; an API key, a tenant's, gets nothing more."""
    proxy = make_proxy(api_keys=["sk-app"], metrics_key="sk-metrics", admin_key="sk-admin")

    def get(path: str, key: str | None = None) -> Any:
        return proxy.client(**({"Authorization": f"Bearer {key}"} if key else {})).get(path)

    plain = get("/healthz")
    assert plain.status_code == 200 and plain.json() == {"status": "ok"}
    assert get("/livez").status_code == 200
    for key in (None, "sk-app", "nope"):
        error = assert_openai_error(get("/metrics", key), 401)
        assert "FLYWHEEL_METRICS_KEY" in error["message"] and error["code"] == "invalid_api_key"
    for key in ("sk-app", "nope"):  # a key, but not one of these: said so, not the status alone
        assert_openai_error(get("/healthz", key), 401)
    for key in ("sk-metrics", "sk-admin"):
        assert "flywheel_requests_total" in get("/metrics", key).text
        health = get("/healthz", key).json()
        assert health["database"] == "up" and fake_vllm.url in health["replicas"]
    assert fake_vllm.url not in plain.text


def test_keys_on_without_a_metrics_key_refuse_metrics_naming_the_setting(make_proxy: Any) -> None:
    proxy = make_proxy(auth="keys")
    error = assert_openai_error(proxy.client().get("/metrics"), 403)
    assert error["code"] == "metrics_disabled" and "FLYWHEEL_METRICS_KEY" in error["message"]
    assert proxy.client().get("/healthz").json() == {"status": "ok"}


def test_keys_off_leave_metrics_and_health_open_unless_a_metrics_key_is_set(
    make_proxy: Any,
) -> None:
    local = make_proxy(admin_key="sk-admin")  # `flywheel up`: loopback, auth off, an admin key
    assert "flywheel_requests_total" in local.client().get("/metrics").text
    assert local.client().get("/healthz").json()["database"] == "up"
    guarded = make_proxy(metrics_key="sk-metrics")
    assert_openai_error(guarded.client().get("/metrics"), 401)
    assert guarded.client().get("/healthz").json() == {"status": "ok"}
    scraped = guarded.client(Authorization="Bearer sk-metrics").get("/metrics")
    assert scraped.status_code == 200


def _count(proxy: RunningProxy, route: str, status: int) -> float:
    line = f'flywheel_requests_total{{route="{route}",status="{status}"}} '
    text = proxy.client().get("/metrics").text
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_completion_errors_are_answered_and_counted_at_the_edge(
    proxy: RunningProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion routes bypass FastAPI: their errors get the same answers and counts."""
    route = "/v1/chat/completions"
    before = {s: _count(proxy, route, s) for s in (200, 400, 500)}
    assert proxy.client().post(route, json=CHAT).status_code == 200
    assert_openai_error(proxy.client().post(route, content=b"{", headers=JSON), 400)

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("proxy.relay.forward.Forwarder.handle", broken)
    error = assert_openai_error(proxy.client().post(route, json=CHAT), 500)
    assert error["type"] == "server_error" and "internal error" in error["message"]
    assert "a bug" not in error["message"]  # the log has it, not the client
    after = {s: _count(proxy, route, s) for s in (200, 400, 500)}
    assert {s: after[s] - before[s] for s in after} == {200: 1, 400: 1, 500: 1}


# --- what a web page could send (issue 31): the body's type, the Host, the dashboard's headers --


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/rewards"])
@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"],
)
def test_a_body_not_declared_json_is_a_415(
    proxy: RunningProxy, fake_vllm: FakeVLLM, route: str, content_type: str | None
) -> None:
    """A page may post text/plain anywhere without a preflight (a CORS simple request)."""
    transition = proxy.client().post("/v1/chat/completions", json=CHAT).headers["x-transition-id"]
    fake_vllm.requests.clear()
    body = CHAT if route != "/v1/rewards" else {"episode_id": "e", "reward": 1.0}
    body = body | {"transition_id": transition} if route == "/v1/rewards" else body
    headers = {"Content-Type": content_type} if content_type else {}
    r = proxy.client().post(route, content=orjson.dumps(body), headers=headers)
    error = assert_openai_error(r, 415)
    assert error["code"] == "unsupported_media_type"
    assert "Content-Type: application/json" in error["message"]
    assert fake_vllm.requests == []
    assert proxy.query("SELECT count(*) FROM reward") == [(0,)]


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", "application/x+json"]
)
def test_json_by_any_of_its_names_is_taken(proxy: RunningProxy, content_type: str) -> None:
    r = proxy.client().post(
        "/v1/chat/completions", content=orjson.dumps(CHAT), headers={"Content-Type": content_type}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/rewards"),
        ("GET", "/ui/api/overview"),
        ("GET", "/v1/episodes/e"),
        ("GET", "/ui/"),
    ],
)
def test_a_loopback_proxy_answers_only_to_loopback_names(
    proxy: RunningProxy, fake_vllm: FakeVLLM, method: str, path: str
) -> None:
    """DNS rebinding: evil.example resolves to 127.0.0.1, and the page's requests carry its name."""
    r = proxy.client().request(method, path, json=CHAT, headers={"Host": "evil.example:8000"})
    error = assert_openai_error(r, 421)
    assert error["code"] == "host_not_allowed" and "FLYWHEEL_ALLOWED_HOSTS" in error["message"]
    assert fake_vllm.requests == []
    for host in ("localhost", "LOCALHOST:1234", "127.0.0.1", "[::1]:8000", "localhost."):
        r = proxy.client().get("/v1/models", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    for path in ("/livez", "/healthz", "/metrics"):  # probes and scrapes call by address
        assert proxy.client().get(path, headers={"Host": "10.0.0.7:8000"}).status_code == 200


def test_allowed_hosts_replace_the_default(make_proxy: Any) -> None:
    proxy = make_proxy(allowed_hosts=["proxy.example", "*.internal"])
    for host, status in [
        ("proxy.example:8000", 200),
        ("a.b.internal", 200),
        ("internal", 421),
        ("127.0.0.1", 421),
        ("evil.example", 421),
    ]:
        assert proxy.client().get("/v1/models", headers={"Host": host}).status_code == status
    anyone = make_proxy(allowed_hosts=["*"])
    assert anyone.client().get("/v1/models", headers={"Host": "evil.example"}).status_code == 200


def test_allowed_hosts_defaults_and_bad_values() -> None:
    assert ProxySettings(host="127.0.0.1").host_names == ["localhost", "127.0.0.1", "[::1]"]
    assert ProxySettings(host="0.0.0.0", api_keys=["k"]).host_names == ["*"]
    given = ProxySettings(host="0.0.0.0", api_keys=["k"], allowed_hosts="a.example, b.example")
    assert given.host_names == ["a.example", "b.example"]
    with pytest.raises(ValueError, match=r"FLYWHEEL_ALLOWED_HOSTS.*without scheme or port"):
        ProxySettings(allowed_hosts="http://a.example:8000")


@pytest.mark.parametrize("path", ["/ui/", "/ui/static/app.js", "/ui/api/overview"])
def test_the_dashboard_may_not_be_framed_or_load_foreign_scripts(
    proxy: RunningProxy, path: str
) -> None:
    r = proxy.client().get(path)
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
