"""One route table (proxy/route_table.py): a route is mounted only with its row, every consumer
(auth, quotas, the Host check, the OpenAPI document) reads the row, and a path without one is
refused before anything is done for it (issue 43, item 1)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter

from core.database import Sessions
from proxy import route_table
from proxy.app import create_app
from proxy.config import ProxySettings
from proxy.route_table import QUERY, TABLE, Doc, Row, Table
from proxy.routes import ops
from tests.conftest import RunningProxy
from tests.core.test_tenants import as_, new_key

SETTINGS = ProxySettings(upstream=["http://127.0.0.1:1"], database_url="postgresql://x@h/db")
WIDGETS = Row(
    "GET",
    "/v1/widgets/{widget_id}",
    "test_route_table",
    "read",
    Doc({"type": "object"}, QUERY | {404: "No such widget."}),
    quota="reads",
)


async def widget(widget_id: str) -> dict[str, str]:
    return {"widget": widget_id}


def mount_widgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler on a router the app mounts (ops'), restored after the test."""
    monkeypatch.setattr(ops, "router", APIRouter(routes=list(ops.router.routes)))
    ops.router.add_api_route(WIDGETS.path, widget, methods=["GET"])


def test_a_route_without_its_row_cannot_be_mounted(monkeypatch: pytest.MonkeyPatch) -> None:
    mount_widgets(monkeypatch)
    with pytest.raises(RuntimeError, match=r"GET /v1/widgets/\{widget_id\} .* has no row"):
        create_app(SETTINGS)


def test_a_row_without_its_route_stops_the_proxy_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(route_table, "ROUTES", Table((*TABLE, WIDGETS)))
    with pytest.raises(RuntimeError, match="has a row but no route"):
        create_app(SETTINGS)


def test_one_path_with_two_accesses_is_refused() -> None:
    post = Row("POST", WIDGETS.path, "test_route_table", "admin", None)
    with pytest.raises(ValueError, match="the same access"):
        Table((WIDGETS, post))


def test_a_new_route_is_one_row_and_every_consumer_reads_it(
    monkeypatch: pytest.MonkeyPatch, make_proxy: Any, sessions: Sessions
) -> None:
    mount_widgets(monkeypatch)
    monkeypatch.setattr(route_table, "ROUTES", Table((*TABLE, WIDGETS)))
    proxy: RunningProxy = make_proxy(
        auth="keys", keys_refresh_s=0.1, quota_reads_rps=0.01, quota_burst_s=100
    )
    infer, reader = new_key(sessions, "acme", "infer"), new_key(sessions, "acme", "read")
    proxy.wait_keys(infer, reader)
    with proxy.client() as c:
        assert c.get("/v1/widgets/w1").status_code == 401  # auth: keys on
        assert c.get("/v1/widgets/w1", headers=as_(reader, Host="evil.example")).status_code == 421
        refused = c.get("/v1/widgets/w1", headers=as_(infer))
        assert refused.status_code == 403, refused.text  # the row's scope
        assert refused.json()["error"]["code"] == "insufficient_scope"
        assert c.get("/v1/widgets/w1", headers=as_(reader)).json() == {"widget": "w1"}
        over = c.get("/v1/widgets/w2", headers=as_(reader))  # the row's quota: one read
        assert over.status_code == 429 and over.headers["Retry-After"], over.text
    operation = create_app(SETTINGS).app.openapi()["paths"]["/v1/widgets/{widget_id}"]["get"]
    assert {"400", "401", "403", "404", "421", "429"} <= set(operation["responses"])
    assert {"ApiKey": []} in operation["security"]


def test_a_path_without_a_row_fails_closed(make_proxy: Any, sessions: Sessions) -> None:
    proxy: RunningProxy = make_proxy(auth="keys", keys_refresh_s=0.1)
    key = new_key(sessions, "acme", "infer,reward,read")
    proxy.wait_keys(key)
    with proxy.client() as c:
        assert c.get("/v1/widgets/w1").status_code == 401  # no key learns which paths exist
        unknown = c.get("/v1/widgets/w1", headers=as_(key))
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
        assert c.get("/admin/adapters/").status_code == 404  # not the route, nor a redirect to it
        assert c.get("/v1/rewards", headers=as_(key)).status_code == 405  # a path, another method
