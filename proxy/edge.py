"""The first thing every request meets (a plain ASGI middleware, cheap on the hot path):

- path-form tags: `/episode/e1/task/t1/v1/...` is routed as `/v1/...` with the tags kept aside;
- auth: with FLYWHEEL_API_KEYS set, `/v1/*` needs `Authorization: Bearer <key>` (never logged);
- the per-route request counter.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy import metrics
from proxy.config import ProxySettings
from proxy.errors import ApiError
from proxy.tags import split_path

KNOWN_ROUTES = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/rewards",
    "/healthz",
    "/metrics",
}


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, settings: ProxySettings) -> None:
        self.app = app
        self._keys = [k.get_secret_value().encode() for k in settings.api_keys]
        self._admin_key = (
            settings.admin_key.get_secret_value().encode() if settings.admin_key else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            try:
                scope = self._route(scope)
            except ApiError as e:
                await e.response()(scope, receive, send_counting)
                return
            await self.app(scope, receive, send_counting)
        finally:
            metrics.requests.labels(_route_label(scope["path"]), str(status)).inc()

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


def _route_label(path: str) -> str:
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/episodes/"):
        return "/v1/episodes/{id}"
    if path.startswith("/admin/"):
        return "/admin"
    return "other"
