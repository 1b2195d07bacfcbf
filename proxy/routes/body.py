"""Reading a JSON request body: its Content-Type, the size limit, and whether it holds a U+0000.

The body must be declared JSON (`application/json`, or `application/*+json`, any parameters):
a web page can send `text/plain` to any address without the browser asking first (a CORS "simple
request"), so a body taken as JSON whatever its type lets any page post to a proxy on loopback.
Every client library (openai, httpx `json=`, requests, LangChain, litellm) declares it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from proxy.errors import ApiError


async def read_json(request: Request, max_bytes: int) -> tuple[Any, bool]:
    """The parsed body, and whether it holds a U+0000 (which Postgres cannot store)."""
    check_json_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(
            413,
            f"request body of {declared} bytes exceeds the limit of {max_bytes}",
            code="payload_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(
                413,
                f"request body exceeds the limit of {max_bytes} bytes",
                code="payload_too_large",
            )
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise ApiError(400, "the request body is empty; send JSON")
    try:
        return orjson.loads(raw), b"\\u0000" in raw
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e


M = TypeVar("M", bound=BaseModel)


def items(body: Any, model: type[M], *, noun: str, most: int, code: str) -> list[M]:
    """A post of one `model` (an object) or several (a list, at most `most`), each validated; a
    400 names the first bad one by its place (`[2].reward`) and what is wrong with it."""
    raw = body if isinstance(body, list) else [body]
    if not raw:
        raise ApiError(400, f"empty list: post at least one {noun}")
    if len(raw) > most:
        raise ApiError(400, f"{len(raw)} {noun}s in one post; at most {most}")
    parsed = []
    for i, item in enumerate(raw):
        try:
            parsed.append(model.model_validate(item))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            param = f"[{i}].{where}" if isinstance(body, list) else where
            raise ApiError(
                400, f"{noun} {param or 'body'}: {first['msg']}", param=param or None, code=code
            ) from e
    return parsed


def check_json_type(content_type: str | None) -> None:
    media = (content_type or "").partition(";")[0].strip().lower()
    if media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    ):
        return
    given = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
    raise ApiError(
        415,
        f"the request body must be JSON sent with `Content-Type: application/json` ({given})",
        code="unsupported_media_type",
    )
