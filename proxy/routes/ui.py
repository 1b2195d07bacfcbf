"""The dashboard: a static app at /ui (proxy/ui/, no build step) and the JSON it reads.

    GET /ui/                              the app (HTML, JS, CSS; uPlot vendored with its licence)
    GET /ui/api/whoami                    what the caller's key may see and do
    GET /ui/api/overview?hours=&agent=&task=   series, versions, facets, queue, lineages, writer
    GET /ui/api/versions?hours=           the reward per version alone (the adapters page)
    GET /ui/api/episodes?q=&task=&agent=&version=&min_reward=&max_reward=&since=&until=
                        &limit=&after=    one keyset page of episodes, newest first
    GET /ui/api/episodes/{id}[?tokens=true]    one episode (the view of GET /v1/episodes/{id})
    GET /ui/api/transitions/{id}/tokens   a completion's tokens with their behaviour logprobs

The static files hold no data and need no key. /ui/api/ needs what /v1/episodes needs (an API key
with the `read` scope: the tenant's own episodes) or the admin key (every tenant's, by stored
id); with auth off, everything (edge.py decides). Adapter actions go to POST /admin/... with the
admin key: the same code path as curl and `flywheel adapters`.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import FileResponse, RedirectResponse, Response

from core import canary, naming, pins, policy
from core.codecs import unpack
from core.database import OUTAGE_ERRORS, run_sync
from core.vllm import VLLMError
from proxy.auth import principal_of
from proxy.config import TAG_PATTERN
from proxy.errors import ApiError, database_error
from proxy.record.store import dashboard
from proxy.routes.admin import canary_json, pin_json
from proxy.routes.episodes import read_episode
from proxy.routes.query import IsoTime
from proxy.services import ServicesDep

STATIC = Path(__file__).resolve().parent.parent / "ui"
# The windows' limits: each read aggregates every call in its window (bounded again by
# FLYWHEEL_READ_TIMEOUT_S). The overview's is its page's longest choice; the adapters page asks
# for 30 days. Further back: `flywheel export` or GET /v1/export.
MAX_OVERVIEW_HOURS = 24 * 7
MAX_VERSIONS_HOURS = 24 * 30
MAX_TOKENS_SHOWN = 2048  # a completion's tokens coloured at most
# Filters are what could have been stored (a tag, a version): anything else is a 400, not a query.
TAG_OR_EMPTY = f"{TAG_PATTERN}|^$"  # (the page's forms send empty fields)
ID_PREFIX = r"^[A-Za-z0-9._:@+=-]{0,200}$"  # the start of an episode id

# The JSON is in the OpenAPI schema (so bench/fuzz generates requests for it); the page is not.
router = APIRouter()


@router.get("/ui", include_in_schema=False)
async def app_root() -> Response:
    return RedirectResponse("/ui/")


@router.get("/ui/", include_in_schema=False)
async def app_page() -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/ui/api/whoami")
async def whoami(request: Request, services: ServicesDep) -> Response:
    principal = principal_of(request.scope)
    return _json(
        {
            "tenant": "*" if principal.every_tenant else (principal.tenant or "default"),
            "admin": bool(request.scope.get("flywheel.admin")),
            "admin_enabled": services.settings.admin_key is not None,
            "auth": services.settings.auth_on,
        }
    )


def _check_window(hours: float, most: int) -> None:
    if not hours <= most:  # (inf too)
        raise ApiError(
            400,
            f"`hours` must be at most {most} ({most // 24} days) here: the window's every call "
            "is read; for longer, use `flywheel export` or GET /v1/export",
            param="query.hours",
            code="window_too_long",
        )


@router.get("/ui/api/overview")
async def overview(
    request: Request,
    services: ServicesDep,
    hours: float = Query(6.0, gt=0),
    agent: str | None = Query(None, pattern=TAG_OR_EMPTY),
    task: str | None = Query(None, pattern=TAG_OR_EMPTY),
) -> Response:
    _check_window(hours, MAX_OVERVIEW_HOURS)
    principal = principal_of(request.scope)
    until = datetime.now(UTC)
    window = dashboard.Window(
        since=until - timedelta(hours=hours),
        until=until,
        agent=agent or None,
        task=principal.own(task) if task else None,
    )
    # A tenant sees its own lineages' versions, pins and canaries (`acme.*`; the default
    # tenant's have no dot), the operator every one: a pin's note and a canary's evidence (its
    # arms' reward means) are another tenant's business.
    tenant = canary.EVERY_TENANT if principal.every_tenant else principal.tenant
    try:
        async with services.sessionmaker() as session:
            body = await dashboard.overview(principal, window, session=session)
            currents = await run_sync(session, policy.currents)
            held = await run_sync(session, pins.by_lineage)
            canaries = await run_sync(session, canary.history, limit=10, tenant=tenant)
    except OUTAGE_ERRORS as e:
        raise database_error(e, narrow="ask for fewer hours, or filter by agent or task") from e
    recorder = services.recorder
    body["lineages"] = [
        {
            "lineage": lineage,
            "version": a.version if a else policy.BASE_VERSION,
            "name": a.name if a else None,
            "since": a.created_at.isoformat() if a else None,
            "pinned": pin_json(held.get(lineage)),
        }
        for lineage in sorted(set(currents) | set(held))
        if principal.every_tenant or naming.tenant_of_lineage(lineage) == principal.tenant
        for a in [currents.get(lineage)]
    ]
    body["canaries"] = [canary_json(c) for c in canaries]
    # This replica's recording: whether it works; its backlog (every tenant's calls) to the
    # operator only.
    body["writer"] = {"database_up": recorder.database_up and services.migrator.migrated}
    if principal.every_tenant:
        body["writer"] |= {"queued": recorder.queue_depth, "journaled": recorder.journal.pending}
    return _json(body)


@router.get("/ui/api/versions")
async def versions(
    request: Request, services: ServicesDep, hours: float = Query(720.0, gt=0)
) -> Response:
    """The reward each version earned in service (the adapters page): the overview's per-version
    table alone, without its series and facets."""
    _check_window(hours, MAX_VERSIONS_HOURS)
    until = datetime.now(UTC)
    window = dashboard.Window(since=until - timedelta(hours=hours), until=until)
    try:
        async with services.sessionmaker() as session:
            rows = await dashboard.reward_per_version(
                principal_of(request.scope), window, session=session
            )
    except OUTAGE_ERRORS as e:
        raise database_error(e, narrow="ask for fewer hours") from e
    return _json({"object": "list", "data": rows})


@router.get("/ui/api/episodes")
async def list_episodes(
    request: Request,
    services: ServicesDep,
    q: str | None = Query(None, pattern=ID_PREFIX),
    task: str | None = Query(None, pattern=TAG_OR_EMPTY),
    agent: str | None = Query(None, pattern=TAG_OR_EMPTY),
    version: int | None = Query(None, ge=0, le=policy.MAX_VERSION),
    min_reward: float | None = Query(None, allow_inf_nan=False),
    max_reward: float | None = Query(None, allow_inf_nan=False),
    since: IsoTime | None = None,
    until: IsoTime | None = None,
    limit: int = Query(50, ge=1, le=200),
    after: str | None = Query(None, max_length=1024),
) -> Response:
    principal = principal_of(request.scope)
    where = dashboard.EpisodeFilter(
        search=q or None,
        task=principal.own(task) if task else None,
        agent=agent or None,
        version=version,
        min_reward=min_reward,
        max_reward=max_reward,
        since=since,
        until=until,
    )
    try:
        async with services.sessionmaker() as session:
            page = await dashboard.episodes(
                principal, where, limit=limit, after=after or None, session=session
            )
    except dashboard.BadCursor as e:
        raise ApiError(400, str(e), param="after") from e
    except OUTAGE_ERRORS as e:
        raise database_error(
            e, narrow="filter by task, version or since/until, or ask for a smaller limit"
        ) from e
    return _json(page)


@router.get("/ui/api/episodes/{episode_id:path}")
async def get_episode(
    episode_id: str, request: Request, services: ServicesDep, tokens: bool = False
) -> Response:
    return await read_episode(principal_of(request.scope), episode_id, services, tokens=tokens)


@router.get("/ui/api/transitions/{transition_id}/tokens")
async def transition_tokens(
    transition_id: str, request: Request, services: ServicesDep
) -> Response:
    principal = principal_of(request.scope)
    try:
        uuid.UUID(transition_id)
        async with services.sessionmaker() as session:
            found = await dashboard.completion_tokens(principal, transition_id, session=session)
    except OUTAGE_ERRORS as e:
        raise database_error(e, narrow="retry later") from e
    except ValueError:  # not a uuid: no such transition either
        found = None
    if found is None:
        raise ApiError(404, f"no transition {transition_id!r}", code="transition_not_found")
    ids = unpack(found[0], "i") or []
    logprobs = unpack(found[1], "f") or []
    shown = ids[:MAX_TOKENS_SHOWN]
    texts: list[str | None] = [None] * len(shown)
    note = None
    try:  # each distinct id once per proxy, a bounded number a page (proxy/relay/token_texts.py)
        texts, unasked = await services.upstream.token_texts.texts(
            services.upstream.any_url(), shown
        )
    except VLLMError as e:
        note = f"vLLM could not detokenize ({e}); showing token ids"
    else:
        if unasked:
            note = f"{unasked} distinct tokens not detokenized yet (shown as ids); reload for more"
    tokens = [
        {"id": t, "text": text, "logprob": logprobs[i] if i < len(logprobs) else None}
        for i, (t, text) in enumerate(zip(shown, texts, strict=True))
    ]
    return _json({"tokens": tokens, "total": len(ids), "note": note})
