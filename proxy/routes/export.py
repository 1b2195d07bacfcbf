"""GET /v1/export: a tenant's own recorded data as JSON Lines, streamed (core/export.py).

    GET /v1/export?kind=transitions|sft|pairs&tokens=&since=&until=&agent=&task=&version=
                   &lineage=&min_reward=&max_reward=&trained=

The rows `flywheel export` writes, for the caller's tenant under its own ids (the `read` scope,
as /v1/episodes): for a team without access to the database. One server-side cursor per export
holds one pooled connection while the client reads, so at most MAX_EXPORTS run at once per
proxy (429 beyond; `Services.export_slots`), leaving the pool to the writer and the API. A
failure mid-stream ends the stream early (the rows sent are whole lines); the client can resume
with `since` = the last `requested_at` it got (kind=transitions).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Literal

import orjson
from fastapi import APIRouter, Query, Request
from sqlalchemy import text
from starlette.responses import Response, StreamingResponse

from core import export, policy
from core.database import OUTAGE_ERRORS
from proxy.auth import principal_of
from proxy.config import TAG_PATTERN
from proxy.errors import ApiError, database_error
from proxy.services import MAX_EXPORTS, ServicesDep

router = APIRouter()


@router.get("/v1/export")
async def export_rows(
    request: Request,
    services: ServicesDep,
    kind: Literal["transitions", "sft", "pairs"] = "transitions",
    tokens: bool = False,
    since: datetime | None = None,
    until: datetime | None = None,
    agent: str | None = Query(None, pattern=TAG_PATTERN),
    task: str | None = Query(None, pattern=TAG_PATTERN),
    version: int | None = Query(None, ge=0, le=policy.MAX_VERSION),
    lineage: str | None = Query(None, pattern=f"^{policy.LINEAGE_NAME.pattern}$"),
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
    q = export.query(kind, where, tokens=tokens)
    slots = services.export_slots
    if slots.locked():
        raise ApiError(
            429,
            f"{MAX_EXPORTS} exports are running on this proxy; retry when one is done",
            type="rate_limit_error",
            code="too_many_exports",
        )
    await slots.acquire()
    # The query starts here, so an unreachable database is a 503 rather than an empty stream.
    session = services.sessionmaker()
    try:
        result = await session.stream(
            text(q.sql), q.params, execution_options={"yield_per": export.BATCH}
        )
    except BaseException as e:
        await session.close()
        slots.release()
        if isinstance(e, OUTAGE_ERRORS):
            raise database_error(
                e, narrow="narrow it with since/until, agent, task or version"
            ) from e
        raise

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for partition in result.mappings().partitions():
                shaped = (q.shape(dict(row)) for row in partition)
                yield b"".join(
                    orjson.dumps(out, option=orjson.OPT_APPEND_NEWLINE)
                    for out in shaped
                    if out is not None
                )
        finally:
            await result.close()
            await session.close()
            slots.release()

    return StreamingResponse(lines(), media_type="application/x-ndjson")
