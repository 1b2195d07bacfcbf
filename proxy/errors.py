"""Errors at the HTTP edge, in OpenAI's shape: {"error": {"message", "type", "param", "code"}};
at the Anthropic Messages route (`/v1/messages`) in Anthropic's: {"type": "error", "error":
{"type", "message"}}, the type following the status code as Anthropic's API has it."""

from __future__ import annotations

import logging
import uuid

import orjson
from starlette.responses import Response

from core.database import query_canceled

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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers or {}  # the answer's own, e.g. a 429's Retry-After

    def response(
        self, headers: dict[str, str] | None = None, *, anthropic: bool = False
    ) -> Response:
        headers = {**self.headers, **(headers or {})}
        if anthropic:
            return anthropic_error_response(self.status, self.message, headers=headers)
        return error_response(
            self.status,
            self.message,
            type=self.type,
            param=self.param,
            code=self.code,
            headers=headers,
        )


def database_error(error: BaseException, *, narrow: str) -> ApiError:
    """A read Postgres did not answer: cancelled past FLYWHEEL_READ_TIMEOUT_S (SQLSTATE 57014),
    a 503 that says how to ask for less (`narrow`); otherwise unreachable."""
    if query_canceled(error):
        return ApiError(
            503,
            f"the query took longer than this proxy allows (FLYWHEEL_READ_TIMEOUT_S) and was "
            f"cancelled: {narrow}",
            type="service_unavailable",
            code="query_timeout",
        )
    return ApiError(503, "database unavailable", type="service_unavailable")


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


def unexpected_error(*, anthropic: bool = False) -> Response:
    """A bug, not the client's fault: logged with an id the client gets to quote."""
    error_id = uuid.uuid4().hex[:12]
    log.exception("unexpected error %s", error_id)
    message = f"internal error {error_id} (see the proxy's log)"
    if anthropic:
        return anthropic_error_response(500, message)
    return error_response(500, message, type="server_error")


# Anthropic's error type for each status (others: invalid_request_error below 500, else api_error)
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_body(status: int, message: str) -> bytes:
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def anthropic_error_response(
    status: int, message: str, *, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        anthropic_body(status, message),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
