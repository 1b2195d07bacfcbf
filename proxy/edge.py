"""The first thing every request meets: the outermost ASGI app, in front of FastAPI.

- path-form tags: `/episode/e1/task/t1/v1/...` is served as `/v1/...` with the tags kept aside;
- the Host check (proxy/hosts.py: a 421 for a name not allowed, against DNS rebinding);
- auth, by the path's row in proxy/route_table.py (its `access`); a path without a row is a 404
  before anything else (fails closed; on `/v1/` after the key check, so that no key learns which
  paths exist). With keys on (FLYWHEEL_API_KEYS or FLYWHEEL_AUTH=keys), `/v1/*` needs
  `Authorization: Bearer <key>` (never logged) with the route's scope; the caller's Principal
  (its tenant: proxy/auth.py, core/tenants.py) goes into the scope as `flywheel.principal`;
  Anthropic's Messages route takes the key as `x-api-key` too, as Anthropic's clients send it;
  the dashboard's `/ui/api/*` takes the same keys, or the admin key for every tenant's rows;
  `/metrics` and `/healthz`'s detail (replica URLs, the journal, every lineage) take the metrics
  or the admin key once keys are on (or FLYWHEEL_METRICS_KEY is set); `/healthz` without a key
  still answers its status (Kubernetes' probes), `/livez` is open;
- the fast lane: the completion routes (`wire.ENDPOINTS`, every agent call) go straight to
  `routes.completions.complete`, not through FastAPI's middleware stack, router and exception
  handlers (about 5% of the proxy's busy samples at 64 clients, by py-spy); their errors get the
  same OpenAI-shaped answers here (Anthropic-shaped at `/v1/messages`, the tags' path form too);
- per-tenant quotas (proxy/quotas.py, when any is set): a 429 before anything else is done,
  and a completion call's slot in flight released once its response has ended, however;
- the dashboard's headers: `/ui` may only be framed by no one and load only its own scripts;
- the per-route request counter (labelled with the route's path template).
"""

from __future__ import annotations

import hmac
from functools import cache

from fastapi import FastAPI
from prometheus_client.metrics import Counter
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from core.tenants import OPERATOR, Principal
from proxy import metrics, route_table
from proxy.auth import require
from proxy.config import ProxySettings
from proxy.errors import ApiError, unexpected_error
from proxy.hosts import HostCheck
from proxy.quotas import Quotas
from proxy.relay import wire
from proxy.relay.tags import split_path
from proxy.route_table import KEY_SCOPES
from proxy.routes.completions import complete
from proxy.services import services_of

_COMPLETIONS = {endpoint.path: endpoint for endpoint in wire.ENDPOINTS}
# The dashboard loads only its own files (no inline script or style: proxy/ui/), is framed by no
# page (clickjacking its adapter buttons), and its files are taken for what they are declared.
UI_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
]


class Edge:
    def __init__(self, app: FastAPI, settings: ProxySettings) -> None:
        self.app = app
        self._hosts = HostCheck(settings.host_names)
        self._auth_on = settings.auth_on
        self._admin_key = (
            settings.admin_key.get_secret_value().encode() if settings.admin_key else None
        )
        self._ops_keys_on = settings.ops_keys_on
        self._ops_keys = [
            key.get_secret_value().encode()
            for key in (settings.metrics_key, settings.admin_key)
            if key is not None
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        status = 500
        try:
            try:
                scope = self._admit(scope)
            except ApiError as e:
                status = e.status
                await e.response(anthropic=_anthropic(scope))(scope, receive, send)
                return
            endpoint = _COMPLETIONS.get(scope["path"])
            if endpoint is not None:
                response = await self._complete(endpoint, scope, receive)
                status = response.status_code
                await response(scope, receive, send)
                return

            dashboard = scope["path"].startswith("/ui")

            async def send_counting(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    if dashboard:
                        message = {**message, "headers": [*message["headers"], *UI_HEADERS]}
                await send(message)

            await self.app(scope, receive, send_counting)
        finally:
            quotas = self._quotas()
            if quotas is not None:
                quotas.release(scope)  # the response has ended, however it ended
            _requests(self._route_label(scope), status).inc()

    async def _complete(self, endpoint: wire.Endpoint, scope: Scope, receive: Receive) -> Response:
        """The completion route's response, or the error answer the app's handlers would give."""
        anthropic = endpoint is wire.MESSAGES
        if scope["method"] != "POST":
            message = f"{scope['method']} {scope['path']}: Method Not Allowed"
            return ApiError(405, message).response({"Allow": "POST"}, anthropic=anthropic)
        try:
            return await complete(endpoint, services_of(self.app), scope, receive)
        except ApiError as e:
            return e.response(anthropic=anthropic)
        except Exception:
            return unexpected_error(anthropic=anthropic)

    def _route_label(self, scope: Scope) -> str:
        """The path template of the route that served it (a bounded set of labels)."""
        if scope["path"] in _COMPLETIONS:
            return str(scope["path"])
        for route in self.app.router.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return str(getattr(route, "path", "other"))
        return "other"

    def _admit(self, scope: Scope) -> Scope:
        """The Host checked, path-form tags taken off the path, then the caller's keys."""
        self._hosts.check(scope)
        split = split_path(scope["path"])
        if split is not None:
            tags, path = split
            scope = dict(scope, path=path, raw_path=path.encode())
            scope["flywheel.path_tags"] = tags
        access, row = route_table.ROUTES.match(scope["method"], scope["path"])
        unknown_v1 = access is None and scope["path"].startswith("/v1/")
        if self._auth_on and (access in KEY_SCOPES or unknown_v1):
            principal = self._api_principal(scope)
            if access is not None:
                require(principal, access, scope["path"])
            scope["flywheel.principal"] = principal
        if access is None:  # fails closed: a path without a row reaches nothing
            message = f"{scope['method']} {scope['path']}: Not Found"
            raise ApiError(404, message, type="NotFoundError")
        if access == "dashboard":
            scope["flywheel.principal"] = self._dashboard_principal(scope)
        if access == "ops":
            scope["flywheel.ops"] = self._ops_detail(scope)
        if access == "admin":
            if self._admin_key is None:
                raise ApiError(
                    403,
                    "admin endpoints are off: set FLYWHEEL_ADMIN_KEY to use them",
                    code="admin_disabled",
                )
            _authorize(scope, [self._admin_key], "FLYWHEEL_ADMIN_KEY")
        quotas = self._quotas()
        if quotas is not None and row is not None and row.quota is not None:
            quotas.admit(scope, row.quota)  # last: a request refused otherwise takes nothing
        return scope

    def _api_principal(self, scope: Scope) -> Principal:
        """The caller of a /v1/ path by its key (Anthropic's SDK sends it as `x-api-key`)."""
        headers = dict(scope["headers"])
        header = headers.get(b"authorization", b"")
        if not header and scope["path"] == wire.MESSAGES.path and b"x-api-key" in headers:
            header = b"Bearer " + headers[b"x-api-key"]
        return services_of(self.app).keys.authenticate(header)

    def _quotas(self) -> Quotas | None:
        """The tenants' quotas (services.py keeps them shared across replicas), if any is set."""
        services = getattr(self.app.state, "services", None)
        return services.quotas if services is not None else None

    def _dashboard_principal(self, scope: Scope) -> Principal:
        """The admin key sees every tenant (and may act); an API key its tenant's rows, with the
        `read` scope /v1/episodes needs; with auth off, everything."""
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = header.partition(b" ")
        admin = self._admin_key
        if admin and scheme.lower() == b"bearer" and hmac.compare_digest(key, admin):
            scope["flywheel.admin"] = True
            return OPERATOR
        if not self._auth_on:
            return OPERATOR
        principal = services_of(self.app).keys.authenticate(header)
        require(principal, "read", scope["path"])
        return principal

    def _ops_detail(self, scope: Scope) -> bool:
        """Whether the caller sees /metrics and /healthz's detail: with the metrics or admin key,
        or anyone while keys are off and no metrics key is set. /healthz without a key answers
        its status alone; /metrics without one is refused."""
        if not self._ops_keys_on:
            return True
        if scope["path"] == "/healthz" and b"authorization" not in dict(scope["headers"]):
            return False
        if not self._ops_keys:
            raise ApiError(
                403,
                "metrics are off while keys are on: set FLYWHEEL_METRICS_KEY (Prometheus sends "
                "it as `Authorization: Bearer <key>`) or FLYWHEEL_ADMIN_KEY",
                code="metrics_disabled",
            )
        _authorize(scope, self._ops_keys, "FLYWHEEL_METRICS_KEY or FLYWHEEL_ADMIN_KEY")
        return True


def _anthropic(scope: Scope) -> bool:
    """Whether the request is at Anthropic's Messages route (its tags' path form too)."""
    return str(scope["path"]).endswith(wire.MESSAGES.path)


def _authorize(scope: Scope, keys: list[bytes], setting: str) -> None:
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, key = header.partition(b" ")
    if scheme.lower() == b"bearer" and any(hmac.compare_digest(key, k) for k in keys):
        return
    raise ApiError(
        401,
        f"Missing or invalid API key: send `Authorization: Bearer <key>`, a key from {setting}.",
        code="invalid_api_key",
    )


@cache  # a handful of (route, status) pairs; prometheus' labels() costs a lock and a lookup
def _requests(route: str, status: int) -> Counter:
    return metrics.requests.labels(route, str(status))
