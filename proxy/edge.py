"""The first thing every request meets: the outermost ASGI app, in front of FastAPI.

- path-form tags: `/episode/e1/task/t1/v1/...` is routed as `/v1/...` with the tags kept aside;
- auth: with FLYWHEEL_API_KEYS set, `/v1/*` needs `Authorization: Bearer <key>` (never logged);
- the fast lane: the two completion routes (every agent call) go straight to their endpoint,
  not through FastAPI's middleware stack, router and exception handlers (about 5% of the proxy's
  busy samples at 64 clients, by py-spy); their errors get the same OpenAI-shaped answers here;
- the per-route request counter.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable
from functools import cache

from prometheus_client.metrics import Counter
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy import metrics
from proxy.config import ProxySettings
from proxy.errors import ApiError, error_response
from proxy.tags import split_path

log = logging.getLogger(__name__)

KNOWN_ROUTES = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/rewards",
    "/healthz",
    "/metrics",
}
# (scope, receive) -> the response to send; raises ApiError for a bad call
Endpoint = Callable[[Scope, Receive], Awaitable[Response]]


class Edge:
    def __init__(self, app: ASGIApp, settings: ProxySettings, fast: dict[str, Endpoint]) -> None:
        self.app = app
        self._fast = fast  # path -> endpoint, for POST
        self._keys = [k.get_secret_value().encode() for k in settings.api_keys]
        self._admin_key = (
            settings.admin_key.get_secret_value().encode() if settings.admin_key else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        status = 500
        try:
            try:
                scope = self._route(scope)
            except ApiError as e:
                status = e.status
                await e.response()(scope, receive, send)
                return
            endpoint = self._fast.get(scope["path"]) if scope["method"] == "POST" else None
            if endpoint is not None:
                response = await _answer(endpoint, scope, receive)
                status = response.status_code
                await response(scope, receive, send)
                return

            async def send_counting(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            await self.app(scope, receive, send_counting)
        finally:
            _requests(_route_label(scope["path"]), status).inc()

    def _route(self, scope: Scope) -> Scope:
        split = split_path(scope["path"])
        if split is not None:
            tags, path = split
            scope = dict(scope, path=path, raw_path=path.encode())
            scope["flywheel.path_tags"] = tags
        if self._keys and scope["path"].startswith("/v1/"):
            _authorize(scope, self._keys, "FLYWHEEL_API_KEYS")
        if scope["path"].startswith("/admin/"):
            if self._admin_key is None:
                raise ApiError(
                    403,
                    "admin endpoints are off: set FLYWHEEL_ADMIN_KEY to use them",
                    code="admin_disabled",
                )
            _authorize(scope, [self._admin_key], "FLYWHEEL_ADMIN_KEY")
        return scope


async def _answer(endpoint: Endpoint, scope: Scope, receive: Receive) -> Response:
    """The endpoint's response, or the error answer the app's handlers would have given."""
    try:
        return await endpoint(scope, receive)
    except ApiError as e:
        return e.response()
    except Exception:
        return unexpected_error()


def unexpected_error() -> Response:
    """A bug, not the client's fault: logged with an id the client gets to quote."""
    error_id = uuid.uuid4().hex[:12]
    log.exception("unexpected error %s", error_id)
    return error_response(
        500, f"internal error {error_id} (see the proxy's log)", type="server_error"
    )


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


def _route_label(path: str) -> str:
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/episodes/"):
        return "/v1/episodes/{id}"
    if path.startswith("/admin/"):
        return "/admin"
    return "other"
