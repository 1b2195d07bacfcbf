"""The admin routes (Authorization: Bearer FLYWHEEL_ADMIN_KEY, checked by the edge):

    GET  /admin/adapters[?lineage=L]      every version (of one lineage), current ones flagged
    GET  /admin/canaries[?lineage=L]      the canaries, newest first: open, promoted, rolled back
    POST /admin/adapters/{N}/activate     roll back (or forward) to version N in its own lineage;
                                          N = 0 with ?lineage=L (default `policy`): L back on
                                          the base model. The other lineages do not move.

Activation is `core.policy.activate`, the same lifecycle the trainer's publish and
`flywheel adapters activate` use: load N into every vLLM replica, then move the alias. A replica
that cannot be reached is ejected here; it rejoins once it has the current adapter
(proxy/replicas.py).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.responses import Response

from core import canary, policy
from core.database import run_sync
from core.tables import Canary as CanaryRow
from core.vllm import AdapterRejected
from proxy.errors import ApiError
from proxy.services import ServicesDep

router = APIRouter()


@router.get("/admin/adapters")
async def list_adapters(services: ServicesDep, lineage: str | None = None) -> Response:
    async with services.sessionmaker() as session:
        adapters = await run_sync(session, policy.versions, lineage=lineage)
    body = {"object": "list", "data": [adapter_json(a) for a in adapters]}
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/admin/canaries")
async def list_canaries(
    services: ServicesDep, lineage: str | None = None, limit: int = 100
) -> Response:
    if not 1 <= limit <= 1000:
        raise ApiError(400, "`limit` must be between 1 and 1000", param="limit")
    async with services.sessionmaker() as session:
        rows = await run_sync(session, canary.history, lineage=lineage, limit=limit)
    data = [canary_json(r) for r in rows]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


@router.post("/admin/adapters/{version}/activate")
async def activate(
    version: int, services: ServicesDep, lineage: str = policy.DEFAULT_LINEAGE
) -> Response:
    upstream = services.upstream
    try:
        policy.check_lineage(lineage)
    except ValueError as e:
        raise ApiError(400, str(e), param="lineage") from e
    try:
        adapter, rollout = await policy.activate(
            version,
            sessions=services.sessionmaker,
            vllm=upstream.vllm,
            urls=[r.base_url for r in upstream.replicas],
            lineage=lineage,
        )
    except policy.UnknownVersion as e:
        raise ApiError(404, str(e), code="adapter_not_found") from e
    except policy.RetiredVersion as e:
        raise ApiError(409, f"{e}; it cannot be activated", code="adapter_retired") from e
    except AdapterRejected as e:
        raise ApiError(
            502,
            f"vLLM refused the adapter: {e}; the alias did not move",
            type="upstream_error",
            code="adapter_rejected",
        ) from e
    except policy.NoReplica as e:
        raise ApiError(502, f"{e}; the alias did not move", type="upstream_error") from e
    for url in rollout.unreachable if rollout else ():
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
    return Response(orjson.dumps(body), media_type="application/json")


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
