"""GET /v1/export: a tenant's own recorded data as JSON Lines, streamed (core/export.py).

    GET /v1/export?kind=transitions|sft|pairs|demonstrations&tokens=&since=&until=&agent=&task=
                   &version=&lineage=&min_reward=&max_reward=&trained=

The rows `flywheel export` writes, for the caller's tenant under its own ids (the `read` scope,
as /v1/episodes): for a team without access to the database. One server-side cursor per export
holds one reader connection while the client reads, so at most FLYWHEEL_EXPORTS_MAX run at once
per proxy and FLYWHEEL_EXPORTS_PER_TENANT of them one tenant's (429 beyond;
`Services.export_slots`), leaving the pool to the API. A client that reads nothing for
FLYWHEEL_EXPORT_IDLE_TIMEOUT_S loses its export (the connection is closed, the slot freed). Each
fetch is bounded by FLYWHEEL_READ_TIMEOUT_S; a failure mid-stream ends the stream early (the
rows sent are whole lines); the client can resume with `since` = the last `requested_at` it got
(kind=transitions).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Literal

import orjson
from fastapi import APIRouter, Query, Request
from sqlalchemy import text
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from core import export, naming, policy
from core.database import OUTAGE_ERRORS
from proxy.auth import principal_of
from proxy.config import TAG_PATTERN
from proxy.disconnect import cancelled_on_disconnect
from proxy.errors import ApiError, database_error
from proxy.routes.query import IsoTime
from proxy.services import ExportSlots, ServicesDep

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/v1/export")
async def export_rows(
    request: Request,
    services: ServicesDep,
    kind: Literal["transitions", "sft", "pairs", "demonstrations"] = "transitions",
    tokens: bool = False,
    since: IsoTime | None = None,
    until: IsoTime | None = None,
    agent: str | None = Query(None, pattern=TAG_PATTERN),
    task: str | None = Query(None, pattern=TAG_PATTERN),
    version: int | None = Query(None, ge=0, le=policy.MAX_VERSION),
    lineage: str | None = Query(None, pattern=f"^{naming.LINEAGE_NAME.pattern}$"),
    min_reward: float | None = Query(None, allow_inf_nan=False),
    max_reward: float | None = Query(None, allow_inf_nan=False),
    trained: bool | None = None,
) -> Response:
    where = export.ExportFilter(
        principal=principal_of(request.scope),
        since=since,
        until=until,
        agent=agent,
        task=task,
        version=version,
        lineage=lineage,
        min_reward=min_reward,
        max_reward=max_reward,
        trained=trained,
    )
    try:
        q = export.query(kind, where, tokens=tokens)
    except ValueError as e:  # a filter the kind has not (a demonstration's version, say)
        raise ApiError(400, str(e), param="kind") from e
    slots, principal = services.export_slots, where.principal
    tenant = "*" if principal.every_tenant else principal.tenant or ""
    refused = slots.take(tenant)
    if refused is not None:
        raise ApiError(429, refused, type="rate_limit_error", code="too_many_exports")
    # The query starts here, so an unreachable database is a 503 rather than an empty stream.
    session = services.sessionmaker()
    try:
        result = await session.stream(
            text(q.sql), q.params, execution_options={"yield_per": export.BATCH}
        )
    except BaseException as e:
        await session.close()
        slots.give_back(tenant)
        if isinstance(e, OUTAGE_ERRORS):
            raise database_error(
                e, narrow="narrow it with since/until, agent, task or version"
            ) from e
        raise

    async def lines() -> AsyncGenerator[bytes]:
        async for partition in result.mappings().partitions():
            shaped = (q.shape(dict(row)) for row in partition)
            yield b"".join(
                orjson.dumps(out, option=orjson.OPT_APPEND_NEWLINE)
                for out in shaped
                if out is not None
            )

    async def close() -> None:  # the cursor, then its connection back to the pool
        try:
            await result.close()
        finally:
            await session.close()

    idle_s = services.settings.export_idle_timeout_s
    return ExportStream(lines(), close, slots, tenant, idle_s=idle_s)


class ExportStream(Response):
    """The lines, streamed; the cursor, its connection (`close`) and the slot released however
    the stream ends: done, the client gone (`http.disconnect`), the client reading nothing for
    `idle_s` (a line that cannot go out for that long: the stream is cut, its connection
    closed), or the response never started (its start refused: the lines' generator never ran,
    so a `finally` inside it would not either)."""

    media_type = "application/x-ndjson"

    def __init__(
        self,
        lines: AsyncGenerator[bytes],
        close: Callable[[], Awaitable[None]],
        slots: ExportSlots,
        tenant: str,
        *,
        idle_s: float,
    ) -> None:
        self.status_code, self.background = 200, None
        self.init_headers()
        self._lines, self._close, self._slots = lines, close, slots
        self._tenant, self._idle_s = tenant, idle_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with cancelled_on_disconnect(receive):
                start = {"type": "http.response.start", "status": 200}
                await send({**start, "headers": self.raw_headers})
                async for chunk in self._lines:
                    await self._send(send, chunk, more=True)
                await self._send(send, b"", more=False)
        except TimeoutError:
            log.warning(
                "an export's client read nothing for %g s (FLYWHEEL_EXPORT_IDLE_TIMEOUT_S): "
                "cut, its slot freed",
                self._idle_s,
            )
        finally:
            try:
                await self._lines.aclose()
                await self._close()
            finally:
                self._slots.give_back(self._tenant)

    async def _send(self, send: Send, chunk: bytes, *, more: bool) -> None:
        # A send waits while the client's socket is full (uvicorn's flow control): that long.
        async with asyncio.timeout(self._idle_s):
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
