"""POST /v1/demonstrations: prompts with the answers they should get, for the trainer's supervised
steps (trainer/learner/sft.py): a warm start from a labelled set, a person's correction, or the best
recorded episodes (`from_episode`: their calls' token ids, exactly as sampled).

One demonstration or a list of them; all stored or none. Each trains one lineage: the one it
names (one the caller may be served: its own, or a shared one it opted into), else the lineage
its `agent`'s calls are served by, else the caller's `policy`. Repeats are answered "duplicate":
a posted one by its idempotency_key (per lineage), a copied call by its transition.

Postgres unreachable: a 503, nothing stored; the post can be repeated as it was (with its keys).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from core import naming
from core.database import OUTAGE_ERRORS
from core.tenants import Principal
from proxy.auth import principal_of
from proxy.errors import ApiError
from proxy.record.recorder import STORED_WAIT_S
from proxy.record.schemas import MAX_DEMONSTRATIONS_PER_POST, DemonstrationIn
from proxy.record.storable import pg_safe
from proxy.record.store import demonstrations
from proxy.record.store.demonstrations import Added
from proxy.routes.body import items as body_items
from proxy.routes.body import read_json
from proxy.services import Services, ServicesDep

router = APIRouter()

_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "oneOf": [
                    DemonstrationIn.model_json_schema(),
                    {
                        "type": "array",
                        "items": DemonstrationIn.model_json_schema(),
                        "minItems": 1,
                        "maxItems": MAX_DEMONSTRATIONS_PER_POST,
                    },
                ]
            }
        }
    },
}


@router.post("/v1/demonstrations", openapi_extra={"requestBody": _BODY})
async def post_demonstrations(request: Request, services: ServicesDep) -> Response:
    body, nul = await read_json(request, services.settings.max_body_bytes)
    principal = principal_of(request.scope)
    out = await store_demonstrations(pg_safe(body) if nul else body, services, principal)
    return Response(orjson.dumps(out), media_type="application/json")


async def store_demonstrations(
    body: Any, services: Services, principal: Principal
) -> dict[str, Any]:
    items = parse(body)
    posted = [_row(d, _lineage(d, services, principal), principal) for d in items if d.messages]
    copies = [d for d in items if d.from_episode is not None]
    for d in copies:
        if d.lineage is not None:
            _lineage(d, services, principal)  # refused if not the caller's to train
        stored = principal.own(d.from_episode or "")
        await services.recorder.wait_stored(stored, timeout=STORED_WAIT_S)  # its last calls
    added: list[list[Added]] = []
    try:
        async with services.reward_sessions.begin() as session:
            created = iter(
                await demonstrations.add_posted(posted, session=session) if posted else []
            )
            for d in items:
                if d.from_episode is None:
                    added.append([next(created)])
                    continue
                added.append(await _copy(d, principal, session))
    except OUTAGE_ERRORS as e:  # nothing stored: the client repeats the post as it was
        raise ApiError(
            503,
            "database unavailable; nothing was stored: repeat the post (idempotency keys, and "
            "an episode's calls, make a repeat store each demonstration once)",
            type="service_unavailable",
            code="database_unavailable",
        ) from e
    results = [
        _result(a, d, principal) for d, group in zip(items, added, strict=True) for a in group
    ]
    if isinstance(body, dict) and items[0].from_episode is None:
        return results[0]  # one posted: its result; an episode's copies are a list
    return {"object": "list", "data": results}


async def _copy(d: DemonstrationIn, principal: Principal, session: Any) -> list[Added]:
    stored = principal.own(d.from_episode or "")
    if not principal.owns_episode(stored) or not await demonstrations.episode_exists(
        stored, session=session
    ):
        raise ApiError(
            404, f"no episode {d.from_episode!r}", param="from_episode", code="episode_not_found"
        )
    copied = await demonstrations.copy_episode(
        stored,
        tenant=principal.tenant,
        lineage=d.lineage,
        agent=d.agent,
        session=session,
    )
    if not copied:
        raise ApiError(
            400,
            f"episode {d.from_episode!r} has no recorded call served by an adapter lineage "
            f"with its token ids{_of(d)}: nothing to learn from",
            param="from_episode",
            code="nothing_to_demonstrate",
        )
    return copied


def _of(d: DemonstrationIn) -> str:
    return "".join(
        f" of {what} {value!r}"
        for what, value in (("lineage", d.lineage), ("agent", d.agent))
        if value
    )


def _lineage(d: DemonstrationIn, services: Services, principal: Principal) -> str:
    """The lineage the demonstration trains, refused (with the ones it may name) if it is not
    one this proxy serves the caller."""
    settings, tenant = services.settings, principal.tenant
    shared = settings.shares(tenant)
    roles = [naming.DEFAULT_LINEAGE, *sorted(set(settings.adapter_per_agent.values()))]
    served = [naming.lineage_for(tenant, role, shared=shared) for role in roles]
    if d.lineage is None:
        return services.alias.lineage_of(d.agent, tenant)
    if not naming.sees(tenant, d.lineage, shared=shared):
        raise ApiError(
            403,
            f"lineage {d.lineage!r} is not one this key may train (its lineages: "
            f"{', '.join(served)})",
            param="lineage",
            code="lineage_forbidden",
        )
    if d.lineage not in served:
        raise ApiError(
            400,
            f"unknown lineage {d.lineage!r}: this proxy serves {', '.join(served)} "
            "(FLYWHEEL_ADAPTER_PER_AGENT names the others)",
            param="lineage",
            code="unknown_lineage",
        )
    return d.lineage


def _row(d: DemonstrationIn, lineage: str, principal: Principal) -> dict[str, Any]:
    assert d.messages is not None and d.completion is not None and not isinstance(d.completion, str)
    return {
        "id": uuid.uuid4(),
        "lineage": lineage,
        "tenant": principal.tenant,
        "source": "posted",
        "episode_id": principal.own(d.episode_id) if d.episode_id else None,
        "task_id": principal.own(d.task_id) if d.task_id else None,
        "agent_name": d.agent,
        "messages": [m.model_dump(exclude_none=True) for m in d.messages],
        "tools": d.tools,
        "completion": d.completion.model_dump(exclude_none=True),
        "idempotency_key": d.idempotency_key,
    }


def _result(a: Added, d: DemonstrationIn, principal: Principal) -> dict[str, Any]:
    return {
        "object": "demonstration",
        "id": str(a.id),
        "lineage": a.lineage,
        "source": "episode" if d.from_episode is not None else "posted",
        "transition_id": str(a.transition_id) if a.transition_id else None,
        "status": a.status,
    }


def parse(body: Any) -> list[DemonstrationIn]:
    items = body_items(
        body,
        DemonstrationIn,
        noun="demonstration",
        most=MAX_DEMONSTRATIONS_PER_POST,
        code="invalid_demonstration",
    )
    keys = [(d.lineage, d.agent, d.idempotency_key) for d in items if d.idempotency_key]
    if len(keys) != len(set(keys)):
        raise ApiError(
            400, "the same idempotency_key appears twice in one post", param="idempotency_key"
        )
    return items
