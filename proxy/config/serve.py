"""The process itself: where it listens, what a request may be, how it stops (the edge and
proxy/main.py read these)."""

from __future__ import annotations

from pydantic import Field

from core.settings import FlywheelSettings


class ServeSettings(FlywheelSettings):
    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port the proxy listens on.")
    keep_alive_s: int = Field(
        65,
        ge=1,
        description="How long an idle client connection is kept open. Longer than the clients' "
        "own idle expiry (httpx, which openai-python uses: 5 s) and load balancers' (often 60 s), "
        "so they close first: a server closing at the same moment races their next request.",
    )
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="Larger request bodies get 413.")
    shutdown_drain_s: float = Field(
        20.0,
        gt=0,
        description="On SIGTERM, how long calls in flight may take to finish (uvicorn's graceful "
        "shutdown) before they are cut.",
    )
    shutdown_flush_s: float = Field(
        10.0,
        gt=0,
        description="Then how long the rest of the shutdown may take: scoring in flight (half of "
        "it at most), then the writer getting its queue into Postgres before the rest goes to "
        "the journal. The pod's termination grace must exceed drain + flush.",
    )
