"""The proxy process: `run(settings)` serves `create_app(settings)` with uvicorn until stopped.

flywheel proxy --upstream http://127.0.0.1:8001 [--host H] [--port P]
"""

from __future__ import annotations

import gc

import uvicorn

from proxy.app import create_app
from proxy.config import ProxySettings
from proxy.edge import Edge


def run(settings: ProxySettings) -> None:
    config = server_config(settings, create_app(settings))
    # Per-call garbage is short-lived; the ~10^5 objects of the imported libraries are not. Keep
    # the collector off the latter (freeze) and run it less often: it took ~20% of the proxy's
    # CPU at 64 clients (py-spy, bench/scaling.md).
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    uvicorn.Server(config).run()


def server_config(settings: ProxySettings, app: Edge) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level.lower(),
        access_log=False,  # requests are counted in /metrics; an access log costs per request
        proxy_headers=False,  # nothing reads the client's address; one ASGI layer less per call
        # In-flight calls finish (up to drain), then the app's shutdown (up to flush:
        # proxy/services.py). uvicorn annotates an int but hands it to asyncio.wait_for: the
        # float is exact, where int() cut 0.5 s to no drain at all.
        timeout_graceful_shutdown=settings.shutdown_drain_s,  # type: ignore[arg-type]
        timeout_keep_alive=settings.keep_alive_s,
    )
