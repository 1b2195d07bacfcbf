"""What operators and clients ask of the proxy itself: GET /v1/models (vLLM's models plus the
policy alias and the provider models), GET /healthz (readiness), GET /livez
(liveness) and GET /metrics (Prometheus).

/healthz's detail names replica URLs, the journal's state and every tenant's lineages: with keys
on it is the metrics (or admin) key's to read; without the key the probes get the status alone,
with the same 200 or 503 (edge.py decides, and refuses /metrics)."""

from __future__ import annotations

import logging

import orjson
from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from core import naming
from core.policy import BASE_VERSION
from core.vllm import VLLMError
from proxy.auth import principal_of
from proxy.errors import ApiError
from proxy.services import Services, ServicesDep

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/v1/models")
async def models(request: Request, services: ServicesDep) -> Response:
    try:
        status, payload = await services.upstream.models()
    except VLLMError as e:
        log.warning("GET /v1/models: %s", e)  # the URL stays in the log, not in the answer
        raise ApiError(502, "vLLM unreachable", type="upstream_error") from e
    if status != 200:
        return Response(payload, status_code=status, media_type="application/json")
    data = orjson.loads(payload)
    tenant = principal_of(request.scope).tenant
    data["data"] = [m for m in data.get("data", []) if _listed_to(tenant, m, services)]
    for model in data["data"]:
        root = model.get("root")
        if isinstance(root, str) and root.startswith("/"):  # a directory on vLLM's disk
            model["root"] = model.get("id")
    created = max((m.get("created", 0) for m in data["data"]), default=0)
    listed = data["data"]
    listed.append(_model(services.settings.policy_alias, created, "flywheel"))
    for name, provider_model in services.settings.routes.items():  # served through litellm
        listed.append(_model(name, created, provider_model.provider))
    return Response(orjson.dumps(data), media_type="application/json")


def _listed_to(tenant: str | None, model: dict[str, object], services: Services) -> bool:
    """Every model but the adapters of lineages the caller may not see (another tenant's)."""
    named = naming.ADAPTER_NAME.fullmatch(str(model.get("id", "")))
    if named is None or model.get("parent") is None:  # not an adapter (a base model)
        return True
    return services.alias.sees(tenant, named.group(1))


def _model(name: str, created: int, owner: str) -> dict[str, object]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": owner,
        "root": None,
        "parent": None,
    }


@router.get("/healthz")
async def healthz(request: Request, services: ServicesDep) -> Response:
    recorder, alias = services.recorder, services.alias
    journal_error = recorder.journal_error
    # Failing (503, out of traffic): Postgres and the journal both fail, records wait in memory.
    # Degraded: the journal fails, Postgres takes everything; an outage now would fill memory.
    status = "failing" if recorder.at_risk else "degraded" if journal_error else "ok"
    code = 503 if status == "failing" else 200
    if not request.scope.get("flywheel.ops"):
        return Response(orjson.dumps({"status": status}), code, media_type="application/json")
    health = {
        "status": status,
        "database": "unreachable since start-up (journaling; migrates once it answers)"
        if not services.migrator.migrated
        else "up"
        if recorder.database_up
        else "unreachable (journaling)",
        "journal": f"failing ({journal_error})" if journal_error else "ok",
        "journal_pending": recorder.journal.pending,
        "journal_quarantined": recorder.journal.quarantined(),
        "writer_queue": recorder.queue_depth,
        # The default lineage's current version, and every lineage's (0: the base model).
        "policy_version": alias.current.get(naming.DEFAULT_LINEAGE, (BASE_VERSION,))[0],
        "lineages": {lineage: version for lineage, (version, _) in sorted(alias.current.items())},
        # Open canaries: the candidate version and the share of episodes it serves.
        "canaries": {
            lineage: {"candidate": c.candidate, "baseline": c.baseline, "fraction": c.fraction}
            for lineage, c in sorted(alias.canaries.items())
        },
        "replicas": {
            r.base_url: {"in_rotation": r.in_rotation, "outstanding": r.outstanding}
            for r in services.upstream.replicas
        },
    }
    return Response(orjson.dumps(health), status_code=code, media_type="application/json")


@router.get("/livez")
async def livez() -> Response:
    """The process answers: Kubernetes' liveness probe. Not /healthz, whose 503 (the journal
    failing) must take the pod out of traffic, not restart it and lose what waits in memory."""
    return Response(b'{"status":"alive"}', media_type="application/json")


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    if not request.scope.get("flywheel.ops"):  # the edge refuses first; this app never serves it
        raise ApiError(401, "/metrics needs FLYWHEEL_METRICS_KEY", code="invalid_api_key")
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
