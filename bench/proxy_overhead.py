"""Proxy overhead: the latency Flywheel adds over calling vLLM directly, and the throughput kept.

A fast fake vLLM (tests/fake_vllm.py: vLLM's exact wire format, 16-token completions with ids and
logprobs, a fixed small latency) in its own process; `flywheel proxy` in its own process, recording
everything into a real Postgres; the load generator (aiohttp, N concurrent clients) in this one.
Direct and proxied runs are interleaved at each concurrency, so drift hits both alike. All three
share two cores here: saturated latency is mostly queueing.

    .venv/bin/python -m bench.proxy_overhead [--concurrency 1,16,64] [--seconds 5]

Not yet here (issue 5): streaming time-to-first-token, LiteLLM's proxy as a third target.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import psutil
import psycopg

from demo.vllm_server import wait_http
from proxy import database
from tests.conftest import free_port

RESULTS = Path(__file__).with_suffix(".md")  # this script's own report
BODY = {
    "model": "demo",
    "messages": [{"role": "user", "content": "What is 3 + 4?"}],
    "max_tokens": 16,
}


async def load(url: str, concurrency: int, seconds: float) -> tuple[list[float], int]:
    """Latencies of successful calls, and the number of failed ones."""
    latencies: list[float] = []
    failed = 0
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession, n: int) -> None:
        nonlocal failed
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            headers = {"X-Episode-Id": f"bench-{n}-{len(latencies)}"}
            async with session.post(url, json=BODY, headers=headers) as response:
                await response.read()
                if response.status == 200:
                    latencies.append(time.perf_counter() - started)
                else:
                    failed += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session, n) for n in range(concurrency)))
    return latencies, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=5.0, help="per target, per round")
    parser.add_argument("--latency-s", type=float, default=0.002, help="the fake's own latency")
    parser.add_argument("--database-url", help="default: an embedded Postgres in a temp dir")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    base = args.database_url or database.embedded_postgres_url(Path(tempfile.mkdtemp()))
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    db_url = database.with_database(base, name)
    fake_port, proxy_port = free_port(), free_port()
    fake = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.fake_vllm",
            "--port",
            str(fake_port),
            "--latency-s",
            str(args.latency_s),
        ],
        stdout=subprocess.DEVNULL,
    )
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "proxy",
            "--upstream",
            f"http://127.0.0.1:{fake_port}",
            "--port",
            str(proxy_port),
        ],
        env={
            **os.environ,
            "FLYWHEEL_DATABASE_URL": db_url,
            "FLYWHEEL_HOME": tempfile.mkdtemp(),
            "FLYWHEEL_LOG_LEVEL": "warning",
        },
    )
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{fake_port}/health", fake, timeout=60)
        wait_http(f"http://127.0.0.1:{proxy_port}/healthz", proxy, timeout=60)
        targets = {
            "direct": f"http://127.0.0.1:{fake_port}/v1/chat/completions",
            "flywheel": f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
        }
        proxy_ps = psutil.Process(proxy.pid)
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            runs: dict[str, list[float]] = {t: [] for t in targets}
            counts = dict.fromkeys(targets, 0)
            failures = dict.fromkeys(targets, 0)
            cpu = 0.0
            for _ in range(2):  # interleaved: direct, flywheel, direct, flywheel
                for target, url in targets.items():
                    before = proxy_ps.cpu_times()
                    latencies, failed = asyncio.run(load(url, concurrency, args.seconds))
                    after = proxy_ps.cpu_times()
                    if target == "flywheel":
                        cpu += (after.user + after.system) - (before.user + before.system)
                    runs[target] += latencies
                    counts[target] += len(latencies)
                    failures[target] += failed
            p = {t: statistics.quantiles(v, n=100) for t, v in runs.items()}
            rps = {t: counts[t] / (2 * args.seconds) for t in targets}
            rows.append(
                {
                    "concurrency": concurrency,
                    "direct_p50_ms": p["direct"][49] * 1e3,
                    "added_p50_ms": (p["flywheel"][49] - p["direct"][49]) * 1e3,
                    "added_p99_ms": (p["flywheel"][98] - p["direct"][98]) * 1e3,
                    "direct_rps": rps["direct"],
                    "flywheel_rps": rps["flywheel"],
                    "ratio": rps["flywheel"] / rps["direct"],
                    "proxy_cpu_per_req_ms": cpu / max(1, counts["flywheel"]) * 1e3,
                    "proxy_rss_mb": proxy_ps.memory_info().rss / 2**20,
                    "failed": failures["flywheel"] + failures["direct"],
                }
            )
        with psycopg.connect(db_url) as conn:
            recorded = conn.execute("SELECT count(*) FROM transition").fetchone()[0]  # type: ignore[index]
    finally:
        for process in (proxy, fake):
            process.terminate()
            process.wait(timeout=30)
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    header = (
        "| when | clients | direct p50 ms | added p50 ms | added p99 ms | direct req/s | "
        "flywheel req/s | ratio | proxy CPU ms/req | proxy RSS MB | failed |"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {time.strftime('%Y-%m-%d %H:%M')} | {r['concurrency']} | {r['direct_p50_ms']:.2f} "
            f"| {r['added_p50_ms']:.2f} | {r['added_p99_ms']:.2f} | {r['direct_rps']:.0f} | "
            f"{r['flywheel_rps']:.0f} | {r['ratio']:.2f} | {r['proxy_cpu_per_req_ms']:.2f} | "
            f"{r['proxy_rss_mb']:.0f} | {r['failed']} |"
        )
    print(header, *lines, f"transitions recorded by the proxy: {recorded}", sep="\n")
    with args.results.open("a") as f:
        if "## Proxy overhead" not in (args.results.read_text() if args.results.exists() else ""):
            f.write(
                "\n## Proxy overhead (non-streaming, fake vLLM)\n\n"
                + header
                + "\n"
                + "|---" * 11
                + "|\n"
            )
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
