"""The proxy's HTTP app: `create_app(settings)` wires the parts; routes stay thin.

What it returns is `Edge` (proxy/edge.py) in front of a FastAPI app: the edge routes the two
completion routes to their endpoint itself and everything else through FastAPI.

Start-up: find the database (configured or embedded), migrate it, start the background writer
(replaying any journal left from before), the upstream client and the alias poller.
Shutdown: stop taking requests, then flush every recorded transition (to Postgres, or to the
journal if Postgres can't take them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy import admin, database, store, wire
from proxy.alias import PolicyAlias
from proxy.config import ProxySettings
from proxy.edge import Edge, Endpoint, unexpected_error
from proxy.errors import ApiError, error_response
from proxy.forward import Forwarder
from proxy.journal import Journal
from proxy.recorder import OUTAGE_ERRORS, STORED_WAIT_S, Recorder
from proxy.replicas import ReplicaKeeper
from proxy.rewards import post_rewards
from proxy.tags import Tags, resolve
from proxy.upstream import Upstream


def create_app(settings: ProxySettings) -> Edge:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = await asyncio.to_thread(database.resolve_url, settings.database_url, settings.home)
        await asyncio.to_thread(database.migrate, url)
        engine = database.create_engine(url)
        sessionmaker = database.create_sessionmaker(engine)
        upstream = Upstream(
            settings.upstream,
            api_key=settings.upstream_api_key.get_secret_value()
            if settings.upstream_api_key
            else None,
            timeout_s=settings.upstream_timeout_s,
        )
        await upstream.start()
        recorder = Recorder(
            sessionmaker,
            Journal(settings.journal_dir),
            batch_size=settings.writer_batch_size,
            queue_max=settings.writer_queue_max,
            retry_s=settings.journal_retry_s,
            gamma=settings.credit_gamma,
        )
        recorder.start()
        alias = PolicyAlias(
            settings.policy_alias,
            sessionmaker,
            upstream,
            base_model=settings.base_model,
            refresh_s=settings.alias_refresh_s,
            listen_url=database.libpq_url(url),
        )
        await alias.start()
        keeper = ReplicaKeeper(upstream, alias, probe_s=settings.replica_probe_s)
        await keeper.start()
        app.state.sessionmaker = sessionmaker
        app.state.recorder = recorder
        app.state.upstream = upstream
        app.state.alias = alias
        app.state.forwarder = Forwarder(upstream, alias, recorder)
        try:
            yield
        finally:
            await keeper.stop()
            await alias.stop()
            await recorder.stop()
            await upstream.close()
            await engine.dispose()

    app = FastAPI(title="Flywheel proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    _add_error_handlers(app)

    fast: dict[str, Endpoint] = {}
    for path, route in (("/v1/chat/completions", "chat"), ("/v1/completions", "completions")):
        endpoint = CompletionEndpoint(route, settings.max_body_bytes, app.state)
        fast[path] = endpoint.respond
        # Edge answers POSTs itself; the router still says 405 to other methods.
        app.router.routes.append(Route(path, endpoint, methods=["POST"], include_in_schema=False))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        status, payload = await request.app.state.upstream.models()
        if status != 200:
            return Response(payload, status_code=status, media_type="application/json")
        data = orjson.loads(payload)
        created = max((m.get("created", 0) for m in data.get("data", [])), default=0)
        data.setdefault("data", []).append(
            {
                "id": settings.policy_alias,
                "object": "model",
                "created": created,
                "owned_by": "flywheel",
                "root": None,
                "parent": None,
            }
        )
        return Response(orjson.dumps(data), media_type="application/json")

    @app.post("/v1/rewards")
    async def rewards(request: Request) -> Response:
        body, nul = await read_json(request, settings.max_body_bytes)
        out = await post_rewards(
            wire.pg_safe(body) if nul else body,
            sessionmaker=request.app.state.sessionmaker,
            recorder=request.app.state.recorder,
            gamma=settings.credit_gamma,
        )
        return Response(orjson.dumps(out), media_type="application/json")

    @app.get("/v1/episodes/{episode_id}")
    async def episode(episode_id: str, request: Request, tokens: bool = False) -> Response:
        await request.app.state.recorder.wait_stored(episode_id, timeout=STORED_WAIT_S)
        try:
            async with request.app.state.sessionmaker() as session:
                data = await store.get_episode(episode_id, session=session, tokens=tokens)
        except OUTAGE_ERRORS as e:
            raise ApiError(503, "database unavailable", type="service_unavailable") from e
        if data is None:
            raise ApiError(
                404, f"no episode {episode_id!r}", param="episode_id", code="episode_not_found"
            )
        return Response(orjson.dumps(data), media_type="application/json")

    @app.get("/admin/adapters")
    async def adapters(request: Request) -> Response:
        async with request.app.state.sessionmaker() as session:
            data = await store.list_adapters(session=session)
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    @app.post("/admin/adapters/{version}/activate")
    async def activate(version: int, request: Request) -> Response:
        found = await admin.activate(
            version,
            sessionmaker=request.app.state.sessionmaker,
            upstream=request.app.state.upstream,
        )
        await request.app.state.alias.refresh()  # this replica follows at once
        return Response(orjson.dumps(found), media_type="application/json")

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        recorder: Recorder = request.app.state.recorder
        return Response(
            orjson.dumps(
                {
                    "status": "ok",
                    "database": "up" if recorder.database_up else "unreachable (journaling)",
                    "journal_pending": recorder.journal.pending,
                    "writer_queue": recorder.queue_depth,
                    "policy_version": request.app.state.alias.current[0]
                    if request.app.state.alias.current
                    else 0,
                    "replicas": {
                        r.base_url: {"in_rotation": r.in_rotation, "outstanding": r.outstanding}
                        for r in request.app.state.upstream.replicas
                    },
                }
            ),
            media_type="application/json",
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return Edge(app, settings, fast)


class CompletionEndpoint:
    """The two completion routes, called by `Edge` without FastAPI's middleware, router and
    per-request dependency machinery: every agent call comes this way."""

    def __init__(self, route: str, max_body_bytes: int, state: State) -> None:
        self._route, self._max_body_bytes, self._state = route, max_body_bytes, state

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        request = Request(scope, receive)
        body, nul = await read_json(request, self._max_body_bytes)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        forwarder: Forwarder = self._state.forwarder
        return await forwarder.handle(self._route, body, tags_of(request), scrub=nul)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.respond(scope, receive)
        await response(scope, receive, send)


def tags_of(request: Request) -> Tags:
    return resolve(request.scope.get("flywheel.path_tags", {}), request.headers)  # type: ignore[arg-type]


async def read_json(request: Request, max_bytes: int) -> tuple[Any, bool]:
    """The parsed body, and whether it holds a U+0000 (which Postgres cannot store)."""
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


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(e.status_code, message, type=kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        return error_response(400, f"{param}: {first['msg']}", param=param)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> Response:
        return unexpected_error()
