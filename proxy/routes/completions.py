"""POST /v1/chat/completions, /v1/completions, /v1/responses and /v1/messages (a route per
`wire.ENDPOINTS`): forwarded to vLLM and recorded by `Forwarder`. The edge calls `complete`
directly, without FastAPI's middleware, router and dependency machinery: every agent call comes
this way.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from proxy.auth import principal_of
from proxy.errors import ApiError
from proxy.relay import wire
from proxy.relay.tags import resolve
from proxy.routes.body import read_json
from proxy.services import Services


async def complete(
    endpoint: wire.Endpoint, services: Services, scope: Scope, receive: Receive
) -> Response:
    request = Request(scope, receive)
    body, nul = await read_json(request, services.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    tags = resolve(
        scope.get("flywheel.path_tags", {}),
        request.headers,  # type: ignore[arg-type]
        principal_of(scope),
    )
    return await services.forwarder.handle(endpoint, body, tags, scrub=nul)
