"""Shutdown fits its budget: calls in flight get exactly FLYWHEEL_SHUTDOWN_DRAIN_S, scoring and
the writer's flush together FLYWHEEL_SHUTDOWN_FLUSH_S, and housekeeping in progress holds nothing
up."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import uvicorn

from demo.vllm_server import free_port
from fakes.vllm import FakeVLLM
from proxy.app import create_app
from proxy.config import ProxySettings
from proxy.main import server_config
from tests.conftest import RunningProxy
from tests.proxy.relay.test_responses import RESPONSE, TOOLS

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


def wait_for(condition: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_drain_is_the_setting_not_its_whole_seconds(
    database_url: str, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    """0.9 s of drain was int()-ed to none at all: a stream in flight was cut at SIGTERM."""
    settings = ProxySettings(
        upstream=[fake_vllm.url],
        database_url=database_url,
        home=tmp_path / "home",
        port=free_port(),
        shutdown_drain_s=0.9,
    )
    config = server_config(settings, create_app(settings))
    assert config.timeout_graceful_shutdown == 0.9
    config.loop = "asyncio"  # the test's thread: not uvloop's global event loop policy
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    fake_vllm.token_delay_s = 0.05  # the stream takes about 0.35 s
    lines = []
    try:
        with (
            RunningProxy(
                f"http://127.0.0.1:{settings.port}", database_url, settings, server, thread
            ).client() as c,
            c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                lines.append(line)
                server.should_exit = True  # SIGTERM, with the stream under way
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert "data: [DONE]" in lines


def test_scoring_in_flight_fits_in_the_flush_time(make_proxy: Any, fake_vllm: FakeVLLM) -> None:
    """Scoring waited up to 10 s of its own at shutdown, outside drain + flush: now it gets half
    the flush time, and its record is stored unscored."""
    proxy: RunningProxy = make_proxy(shutdown_flush_s=2.0)
    fake_vllm.scoring_delay_s = 60
    body = {**RESPONSE, "input": "Please call a tool.", "tools": TOOLS}
    r = proxy.client(**{"X-Episode-Id": "scoring"}).post("/v1/responses", json=body)
    assert r.status_code == 200
    wait_for(lambda: any(q["path"] == "/v1/completions" for q in fake_vllm.requests))
    started = time.monotonic()
    proxy.stop()
    fake_vllm.scoring_delay_s = 0  # (ends the fake's wait)
    assert not proxy.thread.is_alive()
    assert time.monotonic() - started < 2.0 + 3  # (the flush, and a margin for a busy machine)
    [(logprobs,)] = proxy.query(
        "SELECT logprobs FROM transition WHERE episode_id = 'scoring' AND status = 'ok'"
    )
    assert not logprobs  # stored, not scored


def test_shutdown_does_not_wait_for_a_retention_round(make_proxy: Any, database_url: str) -> None:
    """A retention round can take minutes; a stopped proxy's process must not wait for it."""
    with psycopg.connect(database_url) as holder:
        holder.execute("LOCK TABLE message IN ACCESS EXCLUSIVE MODE")  # retention waits on it
        proxy: RunningProxy = make_proxy(retention_days=1)

        def retention_waits() -> bool:
            with psycopg.connect(database_url) as conn:
                waiting = conn.execute(
                    "SELECT 1 FROM pg_locks WHERE NOT granted AND relation = 'message'::regclass"
                ).fetchall()
                return bool(waiting)

        wait_for(retention_waits)
        proxy.server.should_exit = True
        proxy.thread.join(timeout=15)
        assert not proxy.thread.is_alive(), "the proxy waited for the retention round"
        holder.rollback()
