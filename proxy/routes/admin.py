"""The admin routes (Authorization: Bearer FLYWHEEL_ADMIN_KEY, checked by the edge):

    GET  /admin/adapters[?lineage=L]      every version (of one lineage), current ones flagged
    GET  /admin/canaries[?lineage=L]      the canaries, newest first: open, promoted, rolled back
    POST /admin/adapters/{N}/activate     roll back (or forward) to version N in its own lineage;
                                          N = 0 with ?lineage=L (default `policy`): L back on
                                          the base model. The other lineages do not move.
    POST /admin/adapters/{N}/pin[?note=]  activate N and hold its lineage there: the trainer
                                          publishes nothing to it, no canary opens, activate
                                          answers 409 lineage_pinned, until it is unpinned
    POST /admin/lineages/{L}/unpin        let L move again (the trainer goes on from its version)
    GET  /admin/lineages                  each lineage: current version, pin, open canary

Activation is `core.rollout.activate`, the same lifecycle the trainer's publish and
`flywheel adapters activate` use: load N into every vLLM replica, then move the alias. A replica
that cannot be reached is ejected here; it rejoins once it has the current adapter
(proxy/relay/replicas.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Path, Query
from starlette.responses import Response

from core import canary, naming, pins, policy, rollout
from core.database import OUTAGE_ERRORS, run_sync
from core.tables import Canary as CanaryRow
from core.vllm import AdapterRejected
from proxy.errors import ApiError, database_error
from proxy.services import Services, ServicesDep

router = APIRouter()
# What could name a lineage or a version (the columns' own limits): anything else is a 400.
LINEAGE = Query(None, pattern=f"^{naming.LINEAGE_NAME.pattern}$")
LINEAGE_OR_POLICY = Query(naming.DEFAULT_LINEAGE, pattern=f"^{naming.LINEAGE_NAME.pattern}$")
VERSION = Path(ge=policy.BASE_VERSION, le=policy.MAX_VERSION)


@contextlib.asynccontextmanager
async def database() -> AsyncIterator[None]:
    """Postgres unreachable: a 503 that says so, as every route that reads it answers."""
    try:
        yield
    except OUTAGE_ERRORS as e:
        raise database_error(e, narrow="name a lineage, or ask for a smaller limit") from e


@router.get("/admin/adapters")
async def list_adapters(services: ServicesDep, lineage: str | None = LINEAGE) -> Response:
    async with database(), services.sessionmaker() as session:
        adapters = await run_sync(session, policy.versions, lineage=lineage)
    body = {"object": "list", "data": [adapter_json(a) for a in adapters]}
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/admin/canaries")
async def list_canaries(
    services: ServicesDep, lineage: str | None = LINEAGE, limit: int = 100
) -> Response:
    if not 1 <= limit <= 1000:
        raise ApiError(400, "`limit` must be between 1 and 1000", param="limit")
    async with database(), services.sessionmaker() as session:
        rows = await run_sync(session, canary.history, lineage=lineage, limit=limit)
    data = [canary_json(r) for r in rows]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


@router.get("/admin/lineages")
async def list_lineages(services: ServicesDep) -> Response:
    async with database(), services.sessionmaker() as session:
        adapters = await run_sync(session, policy.versions)
        held = await run_sync(session, pins.by_lineage)
        tests = await run_sync(session, canary.opened)
    names = sorted({a.lineage for a in adapters} | set(held))
    current = {a.lineage: a for a in adapters if a.is_current}
    data = [
        {
            "lineage": name,
            "version": current[name].version if name in current else policy.BASE_VERSION,
            "name": current[name].name if name in current else None,
            "pinned": pin_json(held.get(name)),
            "canary": tests[name].candidate if name in tests else None,
        }
        for name in names
    ]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


@router.post("/admin/adapters/{version}/activate")
async def activate(
    services: ServicesDep, version: int = VERSION, lineage: str = LINEAGE_OR_POLICY
) -> Response:
    return await _activate(version, lineage, services)


@router.post("/admin/adapters/{version}/pin")
async def pin(
    services: ServicesDep,
    version: int = VERSION,
    lineage: str = LINEAGE_OR_POLICY,
    note: str | None = Query(None, max_length=500, pattern=r"^[^\x00-\x1f]*$"),
) -> Response:
    return await _activate(version, lineage, services, pin=True, note=note or None)


@router.post("/admin/lineages/{lineage}/unpin")
async def unpin(lineage: str, services: ServicesDep) -> Response:
    """Idempotent: unpinning a lineage that is not pinned answers the same, with `was` null."""
    try:
        naming.check_lineage(lineage)
    except ValueError as e:
        raise ApiError(400, str(e), param="lineage") from e
    async with database(), services.sessionmaker.begin() as session:
        was = await run_sync(session, pins.unpin, lineage=lineage)
    body = {"lineage": lineage, "pinned": None, "was": pin_json(was)}
    return Response(orjson.dumps(body), media_type="application/json")


async def _activate(
    version: int, lineage: str, services: Services, *, pin: bool = False, note: str | None = None
) -> Response:
    upstream = services.upstream
    try:
        naming.check_lineage(lineage)
    except ValueError as e:
        raise ApiError(400, str(e), param="lineage") from e
    try:
        async with database():
            adapter, went = await rollout.activate(
                version,
                sessions=services.sessionmaker,
                vllm=upstream.vllm,
                urls=[r.base_url for r in upstream.replicas],
                lineage=lineage,
                pin=pin,
                note=note,
            )
    except policy.UnknownVersion as e:
        raise ApiError(404, str(e), code="adapter_not_found") from e
    except policy.RetiredVersion as e:
        raise ApiError(409, f"{e}; it cannot be activated", code="adapter_retired") from e
    except pins.Pinned as e:
        raise ApiError(409, str(e), code="lineage_pinned") from e
    except AdapterRejected as e:
        raise ApiError(
            502,
            f"vLLM refused the adapter: {e}; the alias did not move",
            type="upstream_error",
            code="adapter_rejected",
        ) from e
    except rollout.NoReplica as e:
        raise ApiError(502, f"{e}; the alias did not move", type="upstream_error") from e
    for url in went.unreachable if went else ():
        upstream.failed(upstream.replica(url), "unreachable while activating an adapter")
    await services.alias.refresh()  # this proxy follows at once (the others on the NOTIFY)
    if adapter is None:
        body: dict[str, Any] = {
            "version": policy.BASE_VERSION,
            "lineage": lineage,
            "name": None,
            "is_current": True,
        }
    else:
        body = adapter_json(adapter) | {"is_current": True}
    if pin:
        async with database(), services.sessionmaker() as session:
            body["pinned"] = pin_json(await run_sync(session, pins.pin_of, lineage=body["lineage"]))
    return Response(orjson.dumps(body), media_type="application/json")


def pin_json(p: pins.Pin | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {"version": p.version, "since": p.pinned_at.isoformat(), "note": p.note}


def adapter_json(a: policy.Adapter) -> dict[str, Any]:
    return {
        "version": a.version,
        "lineage": a.lineage,
        "name": a.name,
        "path": a.path,
        "is_current": a.is_current,
        "created_at": a.created_at.isoformat(),
        "trained_transitions": a.trained_transitions,
        "stats": a.stats,
        "retired_at": a.retired_at.isoformat() if a.retired_at else None,
    }


def canary_json(r: CanaryRow) -> dict[str, Any]:
    return {
        "id": r.id,
        "lineage": r.lineage,
        "candidate": r.candidate,
        "baseline": r.baseline,
        "fraction": r.fraction,
        "rule": r.rule,
        "opened_at": r.opened_at.isoformat(),
        "decided_at": r.decided_at.isoformat() if r.decided_at else None,
        "action": r.action,
        "reason": r.reason,
        "evidence": r.evidence,
    }
