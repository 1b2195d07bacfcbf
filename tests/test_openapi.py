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

API_KEY, ADMIN_KEY = "sk-openapi-test", "admin-openapi-test"
EXAMPLES = 20  # per operation and generation mode (bench/fuzz.py: 500)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# What the proxy serves outside the document: the dashboard's page and static files.
NOT_DOCUMENTED = {"/ui", "/ui/", "/ui/static"}


def _document() -> dict[str, Any]:
    settings = ProxySettings(upstream=["http://127.0.0.1:9"], database_url="postgresql://-/x")
    return create_app(settings).app.openapi()


OPERATIONS = [
    f"{method.upper()} {path}"
    for path, operations in _document()["paths"].items()
    for method in operations
    if method != "servers"
]


def test_the_document_lists_every_route_the_proxy_serves() -> None:
    settings = ProxySettings(upstream=["http://127.0.0.1:9"], database_url="postgresql://-/x")
    app = create_app(settings).app
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
    return {"right": API_KEY, "wrong": ADMIN_KEY if path.startswith("/v1/") else "nope"}


@pytest.mark.slow
@pytest.mark.parametrize("label", OPERATIONS)
def test_schemathesis_finds_the_proxy_answering_as_documented(
    running: RunningProxy, label: str
) -> None:
    method, path = label.split(" ")
    doc = running.server.config.app.app.openapi()  # with keys on it is not served
    operation = schemathesis.openapi.from_dict(doc)[path][method]
    keys = _keys(path)

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            case=operation.as_strategy(generation_mode=mode),
            key=st.sampled_from(["right", "right", "right", "wrong", None]),
        )
        def call(case: Any, key: str | None) -> None:
            headers = {"Authorization": f"Bearer {keys[key]}"} if key else {}
            if key is None and case.headers:
                case.headers.pop("Authorization", None)
            response = case.call(base_url=running.url, headers=headers, timeout=10)
            case.validate_response(response, checks=CHECKS)

        with contextlib.suppress(Unsatisfiable):  # nothing to make invalid
            call()
