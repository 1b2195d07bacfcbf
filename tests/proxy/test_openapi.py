"""The OpenAPI document (proxy/openapi.py) against the proxy that serves it.

Every route the proxy serves is in the document, and a Schemathesis run over the whole of it
(every operation, the completion routes included: valid and invalid requests, with the right
key, none, or the wrong one) against a running proxy on the fake vLLM and real Postgres finds no
server error, no status the document does not declare, and answers of the declared media type
and schema. `python -m bench.fuzz` runs it (and more) at full size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Mount, Route

from demo.vllm_server import free_port
from fakes.vllm import FakeVLLM
from proxy.app import create_app
from proxy.config import ProxySettings
from proxy.relay import wire
from tests.conftest import RunningProxy, fresh_database, start_proxy

API_KEY, ADMIN_KEY, METRICS_KEY = "sk-openapi-test", "admin-openapi-test", "metrics-openapi"
EXAMPLES = 50  # per operation and generation mode (bench/fuzz.py: 500)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
OUTAGE_CHECKS = [c for c in CHECKS if c is not not_a_server_error]  # the 503s are expected
# Schemathesis' negative cases draw from `random` inside strategies (Hypothesis warns).
SCHEMATHESIS_RANDOM = pytest.mark.filterwarnings(
    "ignore::hypothesis.errors.HypothesisDeprecationWarning"
)
# What the proxy serves outside the document: the dashboard's page and static files.
NOT_DOCUMENTED = {"/ui", "/ui/", "/ui/static"}
COMPLETION_PATHS = {endpoint.path for endpoint in wire.ENDPOINTS}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Headers that frame the HTTP message: the client library's to write. A generated wrong one
# (`Content-Length: float32`) is refused by uvicorn's parser before the app, in plain text.
FRAMING = {"content-length", "transfer-encoding", "host", "connection"}
# A call each completion route answers with 200 (a new endpoint needs one).
VALID = {
    wire.CHAT.name: {"messages": [{"role": "user", "content": "hi"}]},
    wire.COMPLETIONS.name: {"prompt": "hi"},
    wire.RESPONSES.name: {"input": "hi"},
    wire.MESSAGES.name: {"messages": [{"role": "user", "content": "hi"}]},
}

# Enough to build the app (and its document) without starting it.
SETTINGS = ProxySettings(upstream=["http://127.0.0.1:9"], database_url="postgresql://-/x")


def _document() -> dict[str, Any]:
    return create_app(SETTINGS).app.openapi()


OPERATIONS = [
    f"{method.upper()} {path}"
    for path, operations in _document()["paths"].items()
    for method in operations
    if method != "servers"
]


def test_the_document_lists_every_route_the_proxy_serves() -> None:
    app = create_app(SETTINGS).app
    served = {endpoint.path: {"POST"} for endpoint in wire.ENDPOINTS}  # the edge's
    for route in app.routes:
        if isinstance(route, Mount):
            served[route.path] = {"GET"}
        elif isinstance(route, Route):  # FastAPI's APIRoute, and its own /openapi.json
            served.setdefault(route.path.replace(":path}", "}"), set()).update(route.methods or ())
    served.pop("/openapi.json")
    for path in NOT_DOCUMENTED:
        assert served.pop(path), path
    documented = {
        path: {method.upper() for method in operations if method != "servers"}
        for path, operations in app.openapi()["paths"].items()
    }
    assert documented == {path: methods - {"HEAD"} for path, methods in served.items()}


def test_the_document_is_valid_openapi_and_every_error_is_openai_shaped() -> None:
    doc = _document()
    schemathesis.openapi.from_dict(doc).validate()  # against the OpenAPI 3.1 meta-schema
    for label in OPERATIONS:
        method, path = label.split(" ")
        responses = doc["paths"][path][method.lower()]["responses"]
        assert "422" not in responses  # FastAPI's: the app answers 400
        for status, response in responses.items():
            if int(status) >= 400 and path != "/healthz":  # (its 503 is the health report)
                error = response["content"]["application/json"]["schema"]
                shape = "AnthropicError" if path == wire.MESSAGES.path else "Error"
                assert error == {"$ref": f"#/components/schemas/{shape}"}, (label, status)
        if path.startswith("/v1/"):
            assert "401" in responses and "ApiKey" in str(doc["paths"][path][method.lower()])
    assert set(doc["components"]["securitySchemes"]) == {
        "ApiKey",
        "AdminKey",
        "AnthropicKey",
        "MetricsKey",
    }
    for path in ("/metrics", "/healthz"):  # the metrics key's once keys are on
        operation = doc["paths"][path]["get"]
        assert {"401", "403"} <= set(operation["responses"]), path
        assert {"MetricsKey": []} in operation["security"], path
    assert doc["paths"]["/v1/rewards"]["post"]["responses"]["202"]  # journaled


def test_a_route_without_its_row_in_the_route_table_fails_the_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = create_app(SETTINGS).app
    app.add_api_route("/v1/new", lambda: None, methods=["GET"])
    with pytest.raises(LookupError, match=r"GET /v1/new has no doc in proxy/route_table\.py"):
        app.openapi()
    new = wire.Endpoint("new", "/v1/new", "input")
    monkeypatch.setattr(wire, "ENDPOINTS", (*wire.ENDPOINTS, new))
    with pytest.raises(LookupError, match=r"POST /v1/new has no doc in proxy/route_table\.py"):
        create_app(SETTINGS).app.openapi()


@pytest.fixture(scope="module")
def running(postgres_url: str, fake_vllm_server: FakeVLLM, tmp_path_factory: Any) -> Iterator[Any]:
    """One proxy for the whole run, with keys on (the admin routes answer only then)."""
    with fresh_database(postgres_url) as url:
        proxy = start_proxy(
            ProxySettings(
                upstream=[fake_vllm_server.url],
                database_url=url,
                home=Path(tmp_path_factory.mktemp("home")),
                port=free_port(),
                api_keys=[API_KEY],
                admin_key=ADMIN_KEY,
                metrics_key=METRICS_KEY,
                replica_probe_s=60,
            )
        )
        try:
            yield proxy
        finally:
            proxy.stop()


def _keys(path: str) -> dict[str, str]:
    """The key a route takes, and one it does not."""
    if path.startswith("/admin/"):
        return {"right": ADMIN_KEY, "wrong": API_KEY}
    if path in ("/metrics", "/healthz"):
        return {"right": METRICS_KEY, "wrong": API_KEY}
    return {"right": API_KEY, "wrong": ADMIN_KEY if path.startswith("/v1/") else "nope"}


@pytest.mark.slow
@SCHEMATHESIS_RANDOM
@pytest.mark.parametrize("label", OPERATIONS)
def test_schemathesis_finds_the_proxy_answering_as_documented(
    running: RunningProxy, label: str
) -> None:

    fuzz(running, label, (GenerationMode.POSITIVE, GenerationMode.NEGATIVE), EXAMPLES)


def _operation(running: RunningProxy, method: str, path: str) -> Any:
    doc = running.server.config.app.app.openapi()  # with keys on it is not served
    return schemathesis.openapi.from_dict(doc)[path][method]


def fuzz(
    running: RunningProxy,
    label: str,
    modes: tuple[GenerationMode, ...],
    examples: int,
    checks: list[Any] = CHECKS,
) -> None:
    """Schemathesis' cases for one operation, each sent with the route's key, none or another,
    and checked (CHECKS)."""
    method, path = label.split(" ")
    operation = _operation(running, method, path)
    keys = _keys(path)
    for mode in modes:

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            case=operation.as_strategy(generation_mode=mode),
            key=st.sampled_from(["right", "right", "right", "wrong", None]),
            model=st.sampled_from([None, "policy", "demo"]),
        )
        def call(case: Any, key: str | None, model: str | None) -> None:
            headers = {"Authorization": f"Bearer {keys[key]}"} if key else {}
            if key is None and case.headers:
                case.headers.pop("Authorization", None)
            for name in list(case.headers or {}):
                if name.lower() in FRAMING:
                    del case.headers[name]
            if model and path in COMPLETION_PATHS and isinstance(case.body, dict):
                case.body["model"] = model  # a model that is served: answers, not only 404s
            response = case.call(base_url=running.url, headers=headers, timeout=10)
            case.validate_response(response, checks=checks)

        with contextlib.suppress(Unsatisfiable):  # nothing to make invalid
            call()


@pytest.mark.slow
@SCHEMATHESIS_RANDOM
def test_through_a_database_outage_every_answer_is_documented(
    own_postgres: Any, make_proxy: Any
) -> None:
    """Postgres stopped: the routes that read it answer 503, a reward is journaled (202). (A 500
    is no documented status: status_code_conformance fails it.)"""
    proxy = make_proxy(
        database_url=own_postgres.url,
        api_keys=[API_KEY],
        admin_key=ADMIN_KEY,
        metrics_key=METRICS_KEY,
    )
    own_postgres.stop()
    for label in OPERATIONS:
        fuzz(proxy, label, (GenerationMode.POSITIVE,), 5, checks=OUTAGE_CHECKS)
    reward = {"episode_id": "e1", "reward": 1.0}
    case = _operation(proxy, "POST", "/v1/rewards").Case(body=reward, media_type="application/json")
    response = case.call(base_url=proxy.url, headers=AUTH)
    assert response.status_code == 202, response.text
    case.validate_response(response, checks=OUTAGE_CHECKS)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", wire.ENDPOINTS, ids=lambda e: e.name)
def test_a_completion_answers_as_documented_also_through_the_path_form(
    running: RunningProxy, endpoint: wire.Endpoint, stream: bool
) -> None:
    operation = _operation(running, "POST", endpoint.path)
    body = {"model": "policy", "max_tokens": 3, "stream": stream, **VALID[endpoint.name]}
    case = operation.Case(body=body, media_type="application/json")
    checks = [*CHECKS, response_headers_conformance]
    response = case.call(base_url=running.url, headers=AUTH | {"X-Episode-Id": "e-doc"})
    assert response.status_code == 200, response.text
    media = response.headers["content-type"][0]
    assert media.startswith("text/event-stream" if stream else "application/json"), media
    case.validate_response(response, checks=checks)
    # The path form, as the document's server describes it (its variables' defaults).
    servers = running.server.config.app.app.openapi()["paths"][endpoint.path]["servers"]
    (server,) = [s for s in servers if s["url"] != "/"]
    prefix = server["url"].format(**{k: v["default"] for k, v in server["variables"].items()})
    response = case.call(base_url=running.url + prefix, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.headers["x-episode-id"] == ["e1"]
    case.validate_response(response, checks=checks)


def test_a_tenants_quota_answers_429_as_documented(make_proxy: Any) -> None:
    """Every route a quota limits documents its 429 (with Retry-After) as the edge answers it."""
    proxy = make_proxy(
        api_keys=[API_KEY], quota_rps=0.1, quota_rewards_rps=0.1, quota_reads_rps=0.1
    )
    checks = [*CHECKS, response_headers_conformance]
    calls: list[tuple[str, str, Any]] = [
        *(("POST", endpoint.path, VALID[endpoint.name]) for endpoint in wire.ENDPOINTS),
        ("POST", "/v1/rewards", {"episode_id": "e1", "reward": 1.0}),
        ("GET", "/v1/episodes/{episode_id}", None),
        ("GET", "/v1/export", None),
        ("GET", "/ui/api/overview", None),
    ]
    for method, path, body in calls:
        operation = _operation(proxy, method, path)
        more = (
            {"body": {"model": "policy", **body}, "media_type": "application/json"} if body else {}
        )
        params = {"path_parameters": {"episode_id": "e1"}} if "{" in path else {}
        case = operation.Case(**more, **params)
        responses = [case.call(base_url=proxy.url, headers=AUTH) for _ in range(2)]
        assert responses[-1].status_code == 429, (path, responses[-1].text)
        assert "Retry-After" in operation.definition.raw["responses"]["429"]["headers"]
        case.validate_response(responses[-1], checks=checks)
