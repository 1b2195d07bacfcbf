"""The `flywheel` console script as users run it: a real process, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg

from demo.vllm_server import free_port
from fakes.vllm import FakeVLLM

FLYWHEEL = [sys.executable, "-m", "flywheel"]


def test_flywheel_proxy_serves_records_and_flushes_on_sigterm(
    database_url: str, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": database_url, "FLYWHEEL_HOME": str(tmp_path)}
    process = subprocess.Popen(
        [*FLYWHEEL, "proxy", "--upstream", fake_vllm.url, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        ids = []
        for _ in range(20):
            r = httpx.post(
                url + "/v1/chat/completions",
                headers={"X-Episode-Id": "cli"},
                json={"model": "demo", "messages": [{"role": "user", "content": "x"}]},
            )
            ids.append(r.headers["x-transition-id"])
    finally:
        process.send_signal(signal.SIGTERM)  # graceful: the writer flushes before exit
        output = process.communicate(timeout=60)[0].decode()
    # uvicorn re-raises the signal once its shutdown is complete: -SIGTERM is a clean exit.
    assert process.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output

    with psycopg.connect(database_url) as conn:
        stored = conn.execute("SELECT id::text FROM transition").fetchall()
    assert sorted(r[0] for r in stored) == sorted(ids)


def test_bad_settings_fail_at_start_naming_the_fix(tmp_path: Path) -> None:
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path)}
    bad = subprocess.run(
        [*FLYWHEEL, "proxy", "--upstream", "ftp://x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "must start with http:// or https://" in bad.stderr
    missing = subprocess.run(
        [*FLYWHEEL, "proxy"], env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode != 0 and "--upstream" in missing.stderr
    required = subprocess.run(
        [*FLYWHEEL, "migrate"],
        env={**env, "FLYWHEEL_REQUIRE_DATABASE_URL": "true"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert required.returncode != 0 and "FLYWHEEL_DATABASE_URL" in required.stderr
