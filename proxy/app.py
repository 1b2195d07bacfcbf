"""The proxy's HTTP app: `create_app(settings)` wires the parts; the routes live in proxy/routes/.

What it returns is `Edge` (proxy/edge.py) in front of a FastAPI app: the edge answers the
completion routes itself and passes everything else to FastAPI. The lifespan starts the
`Services` (proxy/services.py) every route is handed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from proxy import route_table
from proxy.config import ProxySettings
from proxy.edge import Edge
from proxy.errors import ApiError, error_response, unexpected_error
from proxy.openapi import document
from proxy.routes import admin, demonstrations, episodes, export, ops, rewards, ui
from proxy.services import running


def create_app(settings: ProxySettings) -> Edge:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running(settings) as services:
            app.state.services = services
            yield

    # With keys on, the schema is not served to whoever asks (`app.openapi()` still builds it).
    openapi_url = None if settings.auth_on else "/openapi.json"
    app = FastAPI(
        title="Flywheel proxy",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=openapi_url,
    )
    _add_error_handlers(app)
    for module in (rewards, demonstrations, episodes, export, admin, ops, ui):
        app.include_router(module.router)
    # The whole API's document: FastAPI's routes and the edge's (proxy/openapi.py).
    app.openapi = partial(document, app)  # type: ignore[method-assign]
    app.mount("/ui/static", StaticFiles(directory=ui.STATIC), name="ui-static")
    route_table.ROUTES.check_mounted(mounted(app))  # every route has its row (proxy/route_table.py)
    return Edge(app, settings)


def mounted(app: FastAPI) -> set[tuple[str, str, str]]:
    """The app's routes as (method, path, router): the module of proxy/routes/ that answers."""
    found = set()
    for route in app.router.routes:
        if isinstance(route, APIRoute):
            router = route.endpoint.__module__.rpartition(".")[2]
            found |= {(method, route.path, router) for method in route.methods}
        elif isinstance(route, Mount):  # the dashboard's static files
            found.add(("GET", route.path + "/{file:path}", "ui"))
    return found


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
