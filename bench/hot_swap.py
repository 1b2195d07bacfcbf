"""Hot-swap: from an adapter published to the first call served by it, under steady load.

Steady load (N clients calling the `policy` alias without pause) goes through `flywheel proxy`
(its own process, recording into real Postgres) to a fake vLLM (fakes/vllm.py, its own
process). Meanwhile this script publishes a new adapter version every `--interval` seconds the way
the trainer does: `core.rollout.load_everywhere` (into vLLM first, through the trainer's own
`Replicas`), then `core.policy.publish` in a transaction (which NOTIFYs every proxy). For each
swap it reports:

- routed: publish committed -> the send time of the first call answered by the new version
  (can be slightly negative: the proxy may hear the NOTIFY before the publisher's commit returns);
- served: publish committed -> the first response from the new version arrives (goal <= 100 ms);
- failed calls (any non-200) and stalled calls (slower than `--stall-ms`) over the whole run.

The fake loads adapters instantly; the time a real vLLM takes to load one is the trainer's
`swap` figure (logged per step, metric flywheel_trainer_swap_seconds), reported beside this.

    .venv/bin/python -m bench.hot_swap [--swaps 20] [--interval 0.5] [--clients 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.common import bench_database
from core import database, policy
from fakes.processes import start_fake, start_flywheel
from trainer.vllm import Replicas

RESULTS = Path(__file__).with_suffix(".md")
PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "hot_swap.png"
BODY = {"model": "policy", "messages": [{"role": "user", "content": "What is 3 + 4?"}]}


@dataclass
class Call:
    sent: float
    done: float
    status: int
    version: int | None


async def load(url: str, clients: int, stop: threading.Event, calls: list[Call]) -> None:
    async def client(session: aiohttp.ClientSession, n: int) -> None:
        turn = 0
        while not stop.is_set():
            sent = time.perf_counter()
            headers = {"X-Episode-Id": f"swap-{n}-{turn}"}
            try:
                async with session.post(url, json=BODY, headers=headers) as response:
                    await response.read()
                    version = response.headers.get("X-Policy-Version")
                    status = response.status
            except aiohttp.ClientError:
                version, status = None, 0
            number = int(version) if version and version.isdigit() else None
            calls.append(Call(sent, time.perf_counter(), status, number))
            turn += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, n) for n in range(clients)))


def publish_versions(
    db_url: str, fake_url: str, swaps: int, interval: float, adapters: Path
) -> dict[int, tuple[float, float]]:
    """Publish versions 1..swaps; return version -> (load-into-vLLM seconds, commit time)."""
    engine, sessions = database.create_sessions(db_url)
    admin = Replicas([fake_url], None)
    published: dict[int, tuple[float, float]] = {}
    try:
        for version in range(1, swaps + 1):
            time.sleep(interval)
            name, path = f"policy-v{version}", adapters / f"policy-v{version}"
            path.mkdir()
            load_s = admin.load_everywhere(name, str(path)).seconds
            with sessions.begin() as session:
                policy.publish(
                    session=session,
                    lineage="policy",
                    parent=version - 1 if version > 1 else None,
                    version=version,
                    path=str(path),
                    base_model="demo",
                    stats={},
                    trained_transitions=0,
                )
            published[version] = (load_s, time.perf_counter())
        time.sleep(interval)
    finally:
        admin.close()
        engine.dispose()
    return published


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between publishes")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--latency-s", type=float, default=0.002, help="the fake's own latency")
    parser.add_argument("--stall-ms", type=float, default=1000.0)
    parser.add_argument("--database-url", help="default: an embedded Postgres in a temp dir")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    args = parser.parse_args()

    calls: list[Call] = []
    stop = threading.Event()
    with bench_database(args.database_url) as db_url:
        fake = start_fake(args.latency_s)
        proxy = start_flywheel(fake.url, db_url)
        try:
            url = proxy.url + "/v1/chat/completions"
            loader = threading.Thread(
                target=asyncio.run, args=(load(url, args.clients, stop, calls),), daemon=True
            )
            loader.start()
            started = time.perf_counter()
            published = publish_versions(
                db_url, fake.url, args.swaps, args.interval, Path(tempfile.mkdtemp())
            )
            stop.set()
            loader.join(timeout=60)
            elapsed = time.perf_counter() - started
        finally:
            stop.set()
            proxy.stop()
            fake.stop()

    routed, served = [], []
    for version, (_, committed) in sorted(published.items()):
        by_it = [c for c in calls if c.version == version]
        if not by_it:
            raise SystemExit(f"no call was ever served by v{version}: the alias did not follow")
        routed.append((min(c.sent for c in by_it) - committed) * 1e3)
        served.append((min(c.done for c in by_it) - committed) * 1e3)
    loads = [load_s * 1e3 for load_s, _ in published.values()]
    failed = sum(c.status != 200 for c in calls)
    stalled = sum((c.done - c.sent) * 1e3 > args.stall_ms for c in calls)
    figures = {
        "served_p50": statistics.median(served),
        "served_max": max(served),
        "routed_p50": statistics.median(routed),
        "routed_max": max(routed),
        "load_p50": statistics.median(loads),
        "calls": len(calls),
        "rps": len(calls) / elapsed,
        "failed": failed,
        "stalled": stalled,
    }
    line = (
        f"| {time.strftime('%Y-%m-%d %H:%M')} | {args.swaps} x {args.interval:g} s | "
        f"{args.clients} | {figures['routed_p50']:.1f} / {figures['routed_max']:.1f} | "
        f"{figures['served_p50']:.1f} / {figures['served_max']:.1f} | "
        f"{figures['load_p50']:.1f} | {len(calls)} ({figures['rps']:.0f}/s) | {failed} | "
        f"{stalled} |"
    )
    header = (
        "| when | swaps | clients | routed p50 / max ms | served p50 / max ms | "
        "load into fake p50 ms | calls | failed | stalled |"
    )
    print(header, line, sep="\n")
    met = max(served) <= 100 and not failed
    print(f"goal: served <= 100 ms, zero failed -> {'met' if met else 'MISSED'}")
    text = args.results.read_text() if args.results.exists() else ""
    with args.results.open("a") as f:
        if "| when | swaps |" not in text:
            f.write(
                "# Hot-swap\n\nWritten by `bench/hot_swap.py` (see its docstring). Command: "
                "`.venv/bin/python -m bench.hot_swap`.\n\n" + header + "\n" + "|---" * 9 + "|\n"
            )
        f.write(line + "\n")
    plot(served, routed, args.plot)


def plot(served: list[float], routed: list[float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    swaps = range(1, len(served) + 1)
    ax.plot(swaps, served, "o-", label="first answer from the new version")
    ax.plot(swaps, routed, "s--", label="first call routed to it")
    ax.axhline(100, color="grey", linestyle=":", label="goal (100 ms)")
    ax.set_xlabel("swap")
    ax.set_ylabel("ms after publish committed")
    ax.set_title("Hot-swap under steady load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
