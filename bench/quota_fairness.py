"""Quota fairness (issue 33): does a tenant flooding the proxy move another tenant's latency?

Two tenants' keys on one `flywheel proxy` (keys on, a real Postgres, recording every call) in
front of the fake vLLM (its own process, a fixed latency, and like vLLM a batch of
`--fake-max-running` generations at once, the rest queued: a flood's calls wait there, ahead of
other tenants'). Tenant B calls at a steady rate (open loop: a call every 1/rate s, whatever
the answers do); tenant A is idle, calls at its quota's rate, or floods at `--flood-rps` (open
loop too, in a process of its own so its client work does not delay B's sends). Two proxies are
measured: one with A's quota set (FLYWHEEL_TENANT_QUOTAS: `--quota-rps`, `--quota-concurrency`),
refusing A's excess with 429s, and one without quotas, where A's flood is served. Phases
interleave (forwards, then backwards) so drift hits all alike; the proxy's CPU share while B is
measured is in the table.

With `--replicas N` each of the two is N proxies on the one Postgres, and both tenants' calls go
round-robin over them (a load balancer): the quota holds across replicas (each grants its share,
proxy/quotas.py), so A's answered rate stays at its quota, not N times it.

    PYTHONPATH=. .venv/bin/python -m bench.quota_fairness [--seconds 10] [--rounds 2]
        [--steady-rps 20] [--flood-rps 200] [--quota-rps 20] [--quota-concurrency 4]
        [--latency-s 0.02] [--fake-max-running 4] [--replicas 1] [--note "..."]

Issue 33's goal: a tenant at its quota does not move another tenant's p99 by more than 10 %.
Prints the table and appends a dated section (with this command) to bench/quota_fairness.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import aiohttp

from bench import common
from core import database, tenants
from fakes import processes

REPORT = Path(__file__).with_suffix(".md")
GOAL_P99_MOVE = 0.10  # issue 33: B's p99 moves by at most 10 % while A floods at its quota
BODY = common.chat_body([{"role": "user", "content": "What is 3 + 4?"}], stream=False)


METRICS_KEY = "bench-metrics"  # reads each replica's flywheel_quota_replicas
A_LOADS = ("idle", "at quota", "flooding")  # tenant A: nothing, --quota-rps, --flood-rps


@dataclass
class Phase:
    """One proxy (quota or not) and one load of A's, all rounds together."""

    proxy: str
    a_load: str
    latencies: list[float] = field(default_factory=list)  # B's accepted calls, seconds
    b_failed: int = 0
    a_statuses: Counter[int] = field(default_factory=Counter)
    a_seconds: float = 0.0  # A's calling, as its own process timed it
    proxy_cpu_s: float = 0.0  # the proxy process's CPU time while B was measured
    b_seconds: float = 0.0

    def p(self, q: float) -> float:
        return common.quantile(self.latencies, q) * 1e3


async def open_loop(
    urls: list[str], key: str, rate: float, until: Any, on_answer: Any, episode: str
) -> None:
    """A call every 1/rate s from the start until `until()` says stop, round-robin over `urls`
    (the replicas); each answer to `on_answer(status, seconds)` (status 0: the call failed)."""
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {key}",
        "X-Episode-Id": episode,
    }
    timeout = aiohttp.ClientTimeout(total=common.REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:

        async def call(url: str) -> None:
            started = time.perf_counter()
            try:
                async with session.post(url, data=BODY, headers=headers) as response:
                    await response.read()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError):
                status = 0
            on_answer(status, time.perf_counter() - started)

        tasks = []
        start = time.perf_counter()
        i = 0
        while not until():
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(call(urls[i % len(urls)])))
            i += 1
        await asyncio.gather(*tasks)


def run_loop(coroutine: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


def flood(urls: list[str], key: str, rate: float, ready: Event, stop: Event, out: Any) -> None:
    """Tenant A, in its own process: floods until `stop`, then sends its statuses' counts and
    how long it flooded."""
    statuses: Counter[int] = Counter()
    ready.set()
    started = time.perf_counter()
    run_loop(open_loop(urls, key, rate, stop.is_set, lambda s, _: statuses.update([s]), "a"))
    out.put((dict(statuses), time.perf_counter() - started))


def measure_b(urls: list[str], key: str, rate: float, seconds: float, phase: Phase) -> None:
    deadline = time.perf_counter() + seconds

    def answered(status: int, latency: float) -> None:
        if status == 200:
            phase.latencies.append(latency)
        else:
            phase.b_failed += 1

    run_loop(open_loop(urls, key, rate, lambda: time.perf_counter() > deadline, answered, "b"))


def run_phase(
    urls: list[str],
    keys: dict[str, str],
    args: argparse.Namespace,
    meters: list[common.ProcessMeter],
    phase: Phase,
) -> None:
    def measured() -> None:
        cpu_s, started = sum(m.cpu_s() for m in meters), time.perf_counter()
        measure_b(urls, keys["b"], args.steady_rps, args.seconds, phase)
        phase.proxy_cpu_s += sum(m.cpu_s() for m in meters) - cpu_s
        phase.b_seconds += time.perf_counter() - started

    if phase.a_load == "idle":
        measured()
    else:
        rate = args.quota_rps if phase.a_load == "at quota" else args.flood_rps
        spawn = multiprocessing.get_context("spawn")
        ready, stop, out = spawn.Event(), spawn.Event(), spawn.Queue()
        a = spawn.Process(target=flood, args=(urls, keys["a"], rate, ready, stop, out))
        a.start()
        ready.wait(60)
        time.sleep(0.5)  # A's calls under way before B is measured
        measured()
        stop.set()
        statuses, seconds = out.get(timeout=120)
        phase.a_statuses.update(statuses)
        phase.a_seconds += seconds
        a.join(timeout=60)


def measure_proxy(
    name: str, proxies: list[processes.Server], keys: dict[str, str], args: argparse.Namespace
) -> list[Phase]:
    """B with each of A's loads, interleaved (forwards, then backwards), on one proxy (or its
    replicas, round-robin)."""
    urls = [proxy.url + "/v1/chat/completions" for proxy in proxies]
    measure_b(urls, keys["b"], args.steady_rps, 1.0, Phase(name, "idle"))  # warm-up, uncounted
    meters = [common.ProcessMeter(proxy.process.pid) for proxy in proxies]
    here = {load: Phase(name, load) for load in A_LOADS}
    try:
        for r in range(args.rounds):
            for load in A_LOADS if r % 2 == 0 else reversed(A_LOADS):
                p = here[load]
                run_phase(urls, keys, args, meters, p)
                print(
                    f"{name:>8}, A {load:>8}: B p50 {p.p(0.5):6.1f} ms p99 {p.p(0.99):6.1f} ms "
                    f"(so far), A's answers {dict(p.a_statuses)}",
                    file=sys.stderr,
                )
    finally:
        for meter in meters:
            meter.close()
    return list(here.values())


def make_keys(url: str) -> dict[str, str]:
    """A key for each tenant, made as `flywheel keys create` makes them."""
    engine, sessions = database.create_sessions(url)
    try:
        with sessions.begin() as session:
            return {
                name: tenants.create_key(
                    session=session, tenant=f"tenant-{name}", scopes=["infer"]
                )[1]
                for name in ("a", "b")
            }
    finally:
        engine.dispose()


def each_counts(replicas: list[processes.Server], n: int, timeout_s: float = 60.0) -> None:
    """Until every replica's heartbeat count (`flywheel_quota_replicas`) says `n`: before it, each
    grants a whole quota."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {METRICS_KEY}"}
    for proxy in replicas:
        while (seen := common.metric(proxy.url, "flywheel_quota_replicas", headers=headers)) != n:
            if time.monotonic() > deadline:
                raise SystemExit(f"{proxy.url} counts {seen:g} replicas after {timeout_s:g} s")
            time.sleep(0.5)


def table(phases: list[Phase]) -> list[str]:
    idle = {p.proxy: p for p in phases if p.a_load == "idle"}
    out = [
        "| proxy | tenant A | B p50 ms | B p99 ms | B p99 vs A idle | B calls | B failed "
        "| A sent/s | A answered 200/s | A refused 429/s | A other | proxy CPU % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        a, busy = p.a_statuses, p.a_load != "idle"
        sent = sum(a.values())
        rate = [f"{n / p.a_seconds:,.0f}" if busy else "-" for n in (sent, a[200], a[429])]
        move = f"{p.p(0.99) / idle[p.proxy].p(0.99) - 1:+.0%}" if busy else "-"
        out.append(
            f"| {p.proxy} | {p.a_load} | {p.p(0.5):.1f} | {p.p(0.99):.1f} | {move} | "
            f"{len(p.latencies)} | {p.b_failed} | {rate[0]} | {rate[1]} | {rate[2]} | "
            f"{sent - a[200] - a[429] if busy else '-'} | {p.proxy_cpu_s / p.b_seconds:.0%} |"
        )
    return out


def goal(phases: list[Phase]) -> list[str]:
    by = {(p.proxy, p.a_load): p for p in phases}

    def move(proxy: str, load: str) -> float:
        return by[proxy, load].p(0.99) / by[proxy, "idle"].p(0.99) - 1

    verdict = "met" if move("quota", "flooding") <= GOAL_P99_MOVE else "MISSED"
    return [
        f"B's p99 with A flooding beyond its quota moved {move('quota', 'flooding'):+.1%} (goal "
        f"<= {GOAL_P99_MOVE:.0%}: {verdict}); with A calling at its quota, "
        f"{move('quota', 'at quota'):+.1%}",
        f"without quotas, A's flood moved it {move('no quota', 'flooding'):+.1%}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase, per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per phase")
    parser.add_argument("--steady-rps", type=float, default=20.0, help="tenant B's calls/s")
    parser.add_argument("--flood-rps", type=float, default=200.0, help="tenant A's calls/s")
    parser.add_argument("--quota-rps", type=float, default=20.0, help="tenant A's quota")
    parser.add_argument("--quota-concurrency", type=int, default=4, help="tenant A's quota")
    parser.add_argument("--latency-s", type=float, default=0.02, help="the fake's own latency")
    parser.add_argument(
        "--fake-max-running",
        type=int,
        default=4,
        help="the fake's batch: generations at once, the rest queued (0: no limit)",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="proxies per configuration, round-robin"
    )
    parser.add_argument("--database-url", help="default: an embedded Postgres (.flywheel/bench)")
    parser.add_argument("--results", type=Path, default=REPORT, help="report to append to")
    parser.add_argument("--note", default="", help="a line for the report (e.g. machine state)")
    args = parser.parse_args()
    quota = f"tenant-a:rps={args.quota_rps:g},concurrency={args.quota_concurrency}"
    proxies = {"quota": {"FLYWHEEL_TENANT_QUOTAS": quota}, "no quota": {}}
    phases: list[Phase] = []
    with common.bench_database(args.database_url) as db_url:
        keys = make_keys(db_url)
        fake = processes.start_fake(args.latency_s, max_running=args.fake_max_running)
        try:
            for name, quotas in proxies.items():
                settings = {"FLYWHEEL_AUTH": "keys", "FLYWHEEL_METRICS_KEY": METRICS_KEY, **quotas}
                replicas: list[processes.Server] = []
                try:
                    for _ in range(args.replicas):
                        replicas.append(
                            processes.start_flywheel(fake.url, db_url, settings=settings)
                        )
                    if quotas:
                        each_counts(replicas, args.replicas)
                    phases += measure_proxy(name, replicas, keys, args)
                finally:
                    for proxy in replicas:
                        proxy.stop()
        finally:
            fake.stop()
    lines = [
        f"fake vLLM latency {args.latency_s * 1e3:g} ms, {args.fake_max_running or 'any'} "
        f"generations at once (the rest queued); tenant B {args.steady_rps:g} calls/s, "
        f"tenant A {args.quota_rps:g} calls/s at quota, {args.flood_rps:g} when flooding (all "
        f"open loop, non-streaming chat); A's quota on the `quota` proxy: {quota}; "
        f"{args.replicas} {'replica' if args.replicas == 1 else 'replicas, round-robin'} each; "
        f"{args.seconds:g} s per phase, "
        f"{args.rounds} rounds interleaved; {multiprocessing.cpu_count()} cores shared by the "
        f"proxy, the fake, Postgres and both load generators. {args.note}\n",
        *table(phases),
        "",
        *(f"- {line}" for line in goal(phases)),
    ]
    print(*lines, sep="\n")
    common.append_section(args.results, "Quota fairness", "bench.quota_fairness", lines)
    print("wrote", args.results, file=sys.stderr)


if __name__ == "__main__":
    main()
