"""Durable mode: what it costs (latency, throughput) and what it buys (nothing lost to kill -9).

    PYTHONPATH=. .venv/bin/python -m bench.durable [--concurrency 1,16,64] [--seconds 5]
        [--rounds 2] [--kills 3] [--note "..."]

Cost: the fake vLLM (fakes/vllm.py, 5 ms) behind two `flywheel proxy` processes on one real
Postgres, the default and FLYWHEEL_DURABLE=true, loaded in turn (interleaved rounds) with N
clients calling back to back, non-streaming and streaming chat.

Benefit: for each mode, `--kills` times: 16 clients call a proxy, which is `kill -9`ed after 2 s
while they do; every answer's X-Transition-Id the clients got is "acknowledged". A new proxy on
the same FLYWHEEL_HOME then replays the journal, and acknowledged ids missing from Postgres are
"lost". Default mode may lose what its writer queue held; durable mode must lose nothing.

Prints both tables and appends them to bench/durable.md.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import psycopg

from bench import common
from fakes import processes

RESULTS = Path(__file__).with_suffix(".md")
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]
MODES: dict[str, dict[str, str]] = {"default": {}, "durable": {"FLYWHEEL_DURABLE": "true"}}


def cost(args: argparse.Namespace, upstream: str, db: str) -> list[str]:
    proxies = {m: processes.start_flywheel(upstream, db, settings=env) for m, env in MODES.items()}
    runs: dict[tuple[str, bool, int], common.Run] = {}
    try:
        for clients in args.concurrency:
            for stream in (False, True):
                body = common.chat_body(PROMPT, stream=stream)
                for r in range(args.rounds):
                    order = list(proxies) if r % 2 == 0 else list(reversed(proxies))
                    for mode in order:
                        run = common.load(
                            proxies[mode].url + "/v1/chat/completions",
                            lambda *_, b=body: b,
                            clients,
                            args.seconds,
                            stream=stream,
                        )
                        total = runs.setdefault((mode, stream, clients), common.Run())
                        total.latencies += run.latencies
                        total.failed += run.failed
                        total.elapsed += run.elapsed
    finally:
        for proxy in proxies.values():
            proxy.stop()
    lines = [
        "| clients | stream | mode | p50 ms | p99 ms | req/s | failed |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for (mode, stream, clients), run in sorted(runs.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        lines.append(
            f"| {clients} | {'yes' if stream else 'no'} | {mode} "
            f"| {common.quantile(run.latencies, 0.5) * 1e3:.1f} "
            f"| {common.quantile(run.latencies, 0.99) * 1e3:.1f} "
            f"| {len(run.latencies) / run.elapsed:.0f} | {run.failed} |"
        )
    return lines


async def _drive(url: str, clients: int, acknowledged: set[str]) -> None:
    """Call until the proxy dies; collect the transition ids of every answer received."""
    body = common.chat_body(PROMPT, stream=False)
    tag = uuid.uuid4().hex[:8]

    async def client(session: aiohttp.ClientSession, n: int) -> None:
        headers = {"Content-Type": "application/json", "X-Episode-Id": f"kill-{tag}-{n}"}
        while True:
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    if r.status == 200:
                        acknowledged.update(r.headers["X-Transition-Id"].split(","))
            except (aiohttp.ClientError, TimeoutError):
                return  # the proxy is gone

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await asyncio.gather(*(client(session, n) for n in range(clients)))


def kill_once(mode: str, upstream: str, db: str, clients: int) -> tuple[int, int, int]:
    """(acknowledged, lost before replay, lost after the journal replayed)."""
    home = Path(tempfile.mkdtemp(prefix="flywheel-kill-"))
    proxy = processes.start_flywheel(upstream, db, home=home, settings=MODES[mode])
    acknowledged: set[str] = set()

    async def run() -> None:
        driver = asyncio.create_task(
            _drive(proxy.url + "/v1/chat/completions", clients, acknowledged)
        )
        await asyncio.sleep(2.0)
        proxy.process.send_signal(signal.SIGKILL)
        await driver

    asyncio.run(run())
    proxy.process.wait()
    lost_before = len(acknowledged - stored(db, acknowledged))
    replay = processes.start_flywheel(
        upstream, db, home=home, settings=MODES[mode]
    )  # replays its journal
    deadline = time.monotonic() + 30
    while (missing := acknowledged - stored(db, acknowledged)) and time.monotonic() < deadline:
        time.sleep(0.2)
    replay.stop()
    return len(acknowledged), lost_before, len(missing)


def stored(db: str, ids: set[str]) -> set[str]:
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT id::text FROM transition WHERE id = ANY(%s::uuid[])", (list(ids),)
        ).fetchall()
    return {r[0] for r in rows}


def kills(args: argparse.Namespace, upstream: str, db: str) -> list[str]:
    lines = [
        "| mode | kill -9 runs | acknowledged | missing at restart | lost after journal replay |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        results = [kill_once(mode, upstream, db, 16) for _ in range(args.kills)]
        acked, before, lost = (sum(r[i] for r in results) for i in range(3))
        lines.append(f"| {mode} | {args.kills} | {acked} | {before} | {lost} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--concurrency", default="1,16,64", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--latency-s", type=float, default=0.005)
    parser.add_argument("--database-url")
    parser.add_argument("--note")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    fake = processes.start_fake(args.latency_s)
    try:
        with common.bench_database(args.database_url) as db:
            lines = ["### Cost", "", *cost(args, fake.url, db), "", "### kill -9", ""]
            lines += kills(args, fake.url, db)
    finally:
        fake.stop()
    print("\n".join(lines))
    common.append_report(args.results, "Durable mode", "bench.durable", args, lines)


if __name__ == "__main__":
    main()
