"""Errors at the HTTP edge, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import uuid

import orjson
from starlette.responses import Response

log = logging.getLogger(__name__)


class ApiError(Exception):
    """Raised anywhere in a request; the app turns it into an OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return error_response(
            self.status,
            self.message,
            type=self.type,
            param=self.param,
            code=self.code,
            headers=headers,
        )


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


def unexpected_error() -> Response:
    """A bug, not the client's fault: logged with an id the client gets to quote."""
    error_id = uuid.uuid4().hex[:12]
    log.exception("unexpected error %s", error_id)
    return error_response(
        500, f"internal error {error_id} (see the proxy's log)", type="server_error"
    )
