"""Proxy overhead: what Flywheel's proxy adds over calling vLLM directly, next to LiteLLM's proxy.

A fast fake vLLM (fakes/vllm.py: vLLM's exact wire format, up to 16-token completions, a
fixed small latency) in its own process; `flywheel proxy` in its own process, recording every
call into a real Postgres; LiteLLM's proxy server (1.106.2, one worker, no database, in a venv of
its own under .flywheel/bench/) pointed at the same fake; the load generator (aiohttp on uvloop,
N clients calling back to back) in this process. At each concurrency, for non-streaming and
streaming calls, the targets run interleaved (direct, flywheel, litellm, then the reverse), so
drift hits all alike. Everything shares the machine's cores: saturated latency is mostly queueing.

    PYTHONPATH=. .venv/bin/python -m bench.proxy_overhead [--concurrency 1,16,64,256]
        [--seconds 5] [--rounds 2] [--no-litellm] [--route chat|responses|messages] [--note "..."]

`--route responses` measures `POST /v1/responses` the same way (direct and Flywheel only: the
LiteLLM baseline is measured on chat). `--route messages` measures Anthropic's `POST /v1/messages`
against the chat call the proxy makes of it, sent to the fake directly (vLLM serves Messages by
converting to chat too, so that is the upstream's own cost).

Prints the tables and the goals of issue 16, appends a dated section (with this command) to
bench/proxy_overhead.md and writes docs/img/proxy_overhead_{latency,throughput}.png.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import common, plots
from fakes import processes

RESULTS = Path(__file__).with_suffix(".md")  # this script's own report
IMG_DIR = processes.ROOT / "docs" / "img"
MODES = ("non-streaming", "streaming")
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
DIRECTLY = {"messages": "chat"}  # what the direct baseline calls instead of the route
# Issue 16's goals for Flywheel's proxy (milliseconds added over calling the upstream directly).
GOAL_P50_5MS_MS, GOAL_P99_5MS_MS = 0.5, 1.0  # 1 client, 5 ms upstream (TTFT alike)
GOAL_P50_ZERO_MS = 1.0  # 1 client, any faster upstream
GOAL_CPU_1_MS, GOAL_CPU_64_MS = 0.8, 0.4  # proxy CPU per recorded call
GOAL_DIRECT_RATIO, GOAL_LITELLM_RATIO = 0.6, 25.0  # throughput at 64 clients


@dataclass
class Cell:
    """One target at one concurrency in one mode, all rounds together."""

    mode: str
    clients: int
    target: str
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    failed: int = 0
    elapsed: float = 0.0
    cpu_s: float | None = None  # the proxy process's; None for direct
    peak_rss_mb: float | None = None

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0

    def p(self, q: float, ttft: bool = False) -> float:
        return common.quantile(self.ttfts if ttft else self.latencies, q) * 1e3

    @property
    def cpu_ms_per_request(self) -> float | None:
        if self.cpu_s is None:
            return None
        return self.cpu_s / max(1, len(self.latencies)) * 1e3


def body_for(route: str, mode: str) -> bytes:
    stream = mode == "streaming"
    if route == "responses":
        return common.responses_body(PROMPT[0]["content"], stream=stream)
    return common.chat_body(PROMPT, stream=stream)  # Messages: the same fields


def route_of(route: str, target: str) -> str:
    """The route a target is called on: the direct baseline calls the upstream's."""
    return DIRECTLY.get(route, route) if target == "direct" else route


def measure(
    urls: dict[str, str],
    meters: dict[str, common.ProcessMeter],
    concurrencies: list[int],
    seconds: float,
    rounds: int,
    route: str = "chat",
) -> list[Cell]:
    bodies = {(t, mode): body_for(route_of(route, t), mode) for t in urls for mode in MODES}
    cells: list[Cell] = []
    for clients in concurrencies:
        for mode in MODES:
            stream = mode == "streaming"
            here = {t: Cell(mode, clients, t) for t in urls}
            for r in range(rounds):
                order = list(urls) if r % 2 == 0 else list(reversed(urls))
                for target in order:
                    meter = meters.get(target)
                    cpu_before = meter.cpu_s() if meter else 0.0
                    run = common.load(
                        urls[target],
                        constant(bodies[target, mode]),
                        clients,
                        seconds,
                        stream=stream,
                    )
                    cell = here[target]
                    cell.latencies += run.latencies
                    cell.ttfts += run.ttfts
                    cell.failed += run.failed
                    cell.elapsed += run.elapsed
                    if meter:
                        cell.cpu_s = (cell.cpu_s or 0.0) + meter.cpu_s() - cpu_before
                        cell.peak_rss_mb = meter.peak_rss / 2**20
            for cell in here.values():
                print(
                    f"{mode:>13} {clients:>4} clients {cell.target:>8}: "
                    f"p50 {cell.p(0.5):7.2f} ms  {cell.rps:7.0f} req/s  {cell.failed} failed",
                    file=sys.stderr,
                )
            cells += here.values()
    return cells


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or value != value else f"{value:,.{digits}f}"


def constant(body: bytes) -> common.BodyFactory:
    """The same body for every client and request."""
    return lambda client, number: body


def warm_up(urls: dict[str, str], route: str = "chat") -> dict[str, int]:
    """A short, uncounted load per target and mode (LiteLLM's first calls are slow): calls made."""
    calls = dict.fromkeys(urls, 0)
    for target, url in urls.items():
        for mode in MODES:
            body = constant(body_for(route_of(route, target), mode))
            run = common.load(url, body, 4, 0.5, stream=mode == "streaming")
            calls[target] += len(run.latencies) + run.failed
    return calls


def tables(cells: list[Cell]) -> str:
    direct = {(c.mode, c.clients): c for c in cells if c.target == "direct"}
    by_key = {(c.mode, c.clients, c.target): c for c in cells}
    out = [
        "| mode | clients | target | p50 ms | p99 ms | added p50 ms | added p99 ms | TTFT p50 ms "
        "| TTFT p99 ms | added TTFT p50 ms | added TTFT p99 ms | req/s | failed "
        "| proxy CPU ms/req | proxy peak RSS MB |",
        "|---" * 15 + "|",
    ]
    for c in cells:
        d = direct[(c.mode, c.clients)]
        stream = c.mode == "streaming"
        added = (
            [None] * 4
            if c.target == "direct"
            else [
                c.p(0.5) - d.p(0.5),
                c.p(0.99) - d.p(0.99),
                c.p(0.5, True) - d.p(0.5, True) if stream else None,
                c.p(0.99, True) - d.p(0.99, True) if stream else None,
            ]
        )
        ttft = [c.p(0.5, True), c.p(0.99, True)] if stream else [None, None]
        out.append(
            f"| {c.mode} | {c.clients} | {c.target} | {_f(c.p(0.5))} | {_f(c.p(0.99))} | "
            f"{_f(added[0])} | {_f(added[1])} | {_f(ttft[0])} | {_f(ttft[1])} | "
            f"{_f(added[2])} | {_f(added[3])} | {_f(c.rps, 0)} | {c.failed} | "
            f"{_f(c.cpu_ms_per_request)} | {_f(c.peak_rss_mb, 0)} |"
        )
    out += [
        "",
        "| mode | clients | flywheel / direct req/s | flywheel / litellm req/s |",
        "|---|---|---|---|",
    ]
    for mode, clients in direct:
        fw = by_key[(mode, clients, "flywheel")].rps
        lite = by_key.get((mode, clients, "litellm"))
        vs_lite = fw / lite.rps if lite and lite.rps else None
        out.append(
            f"| {mode} | {clients} | {_f(fw / direct[(mode, clients)].rps)} | {_f(vs_lite, 1)} |"
        )
    return "\n".join(out)


def goals(cells: list[Cell], latency_s: float) -> list[str]:
    """Issue 16's goals next to what this run got. Latency: at 1 client, p50 (and p99 with a
    5 ms upstream, where the upstream's wait is there to hide the proxy's work) for each mode,
    TTFT for streams; CPU per call at 1 and 64 clients; throughput at 64 clients."""
    by_key = {(c.mode, c.clients, c.target): c for c in cells}

    def verdict(value: float, goal: float, at_least: bool = False) -> str:
        ok = value >= goal if at_least else value <= goal
        return f"{value:.2f} ({'>=' if at_least else '<='} {goal:g}: {'met' if ok else 'MISSED'})"

    out = []
    p50_goal = GOAL_P50_5MS_MS if latency_s >= 0.005 else GOAL_P50_ZERO_MS
    for mode in MODES:
        if (fw := by_key.get((mode, 1, "flywheel"))) is not None:
            d = by_key[(mode, 1, "direct")]
            ttft = mode == "streaming"
            line = f"{mode}, 1 client: added {'TTFT ' if ttft else ''}p50 " + verdict(
                fw.p(0.5, ttft) - d.p(0.5, ttft), p50_goal
            )
            if latency_s >= 0.005:
                added_p99 = fw.p(0.99, ttft) - d.p(0.99, ttft)
                line += ", p99 " + verdict(added_p99, GOAL_P99_5MS_MS)
            cpu = fw.cpu_ms_per_request or 0
            out.append(line + ", proxy CPU ms/call " + verdict(cpu, GOAL_CPU_1_MS))
        if (fw := by_key.get((mode, 64, "flywheel"))) is not None:
            d = by_key[(mode, 64, "direct")]
            line = f"{mode}, 64 clients: proxy CPU ms/call " + verdict(
                fw.cpu_ms_per_request or 0, GOAL_CPU_64_MS
            )
            line += ", flywheel/direct " + verdict(fw.rps / d.rps, GOAL_DIRECT_RATIO, True)
            if (lite := by_key.get((mode, 64, "litellm"))) and lite.rps:
                line += ", flywheel/litellm " + verdict(fw.rps / lite.rps, GOAL_LITELLM_RATIO, True)
            out.append(line)
    return out


def plot(cells: list[Cell], img_dir: Path, route: str = "chat") -> list[Path]:
    suffix = "" if route == "chat" else f"_{route}"  # chat keeps the names the docs link
    clients = sorted({c.clients for c in cells})
    targets = list(dict.fromkeys(c.target for c in cells))
    by_key = {(c.mode, c.clients, c.target): c for c in cells}

    def added(mode: str, target: str, q: float, ttft: bool = False) -> list[float]:
        return [
            by_key[(mode, n, target)].p(q, ttft) - by_key[(mode, n, "direct")].p(q, ttft)
            for n in clients
        ]

    proxies = [t for t in targets if t != "direct"]
    latency_panels = {
        "non-streaming: added latency": {
            f"{t} {name}": added("non-streaming", t, q)
            for t in proxies
            for name, q in (("p50", 0.5), ("p99", 0.99))
        },
        "streaming: added time to first token": {
            f"{t} {name}": added("streaming", t, q, ttft=True)
            for t in proxies
            for name, q in (("p50", 0.5), ("p99", 0.99))
        },
    }
    throughput_panels = {
        mode: {t: [by_key[(mode, n, t)].rps for n in clients] for t in targets} for mode in MODES
    }
    return [
        plots.lines(
            img_dir / f"proxy_overhead_latency{suffix}.png",
            clients,
            latency_panels,
            xlabel="concurrent clients",
            ylabel="ms added vs direct (log)",
            title=f"Latency added by the proxy, {PATHS[route]} (fake vLLM upstream)",
            log_y=True,
            hlines={
                "goal p50, 1 client, 5 ms upstream": GOAL_P50_5MS_MS,
                "goal p99, 1 client, 5 ms upstream": GOAL_P99_5MS_MS,
            },
        ),
        plots.lines(
            img_dir / f"proxy_overhead_throughput{suffix}.png",
            clients,
            throughput_panels,
            xlabel="concurrent clients",
            ylabel="requests/s (log)",
            title="Throughput per target (same run, interleaved)",
            log_y=True,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated clients")
    parser.add_argument("--seconds", type=float, default=5.0, help="per target, per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per cell")
    common.add_fake_arguments(parser)
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM's proxy")
    parser.add_argument("--route", choices=sorted(PATHS), default="chat", help="what to call")
    parser.add_argument("--database-url", help="default: an embedded Postgres (.flywheel/bench)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="report to append to")
    parser.add_argument("--img-dir", type=Path, default=IMG_DIR, help="where the PNGs go")
    parser.add_argument("--note", default="", help="a line for the report (e.g. machine state)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    servers: list[processes.Server] = []
    meters: dict[str, common.ProcessMeter] = {}
    with common.bench_database(args.database_url) as db_url:
        try:
            fake = processes.start_fake(args.latency_s, always_detail=not args.lean_fake)
            servers.append(fake)
            flywheel = processes.start_flywheel(fake.url, db_url)
            servers.append(flywheel)
            urls = {"direct": fake.url, "flywheel": flywheel.url}
            meters["flywheel"] = common.ProcessMeter(flywheel.process.pid)
            if not args.no_litellm and args.route == "chat":
                litellm = common.start_litellm(fake.url)
                servers.append(litellm)
                urls["litellm"] = litellm.url
                meters["litellm"] = common.ProcessMeter(litellm.process.pid)
            urls = {t: u + PATHS[route_of(args.route, t)] for t, u in urls.items()}
            warm = warm_up(urls, args.route)["flywheel"]
            cells = measure(urls, meters, concurrencies, args.seconds, args.rounds, args.route)
            calls = warm + sum(len(c.latencies) + c.failed for c in cells if c.target == "flywheel")
            recorded, _ = common.wait_recorded(db_url, calls, timeout=30)
        finally:
            for meter in meters.values():
                meter.close()
            for server in reversed(servers):
                server.stop()

    body = tables(cells)
    goal_lines = goals(cells, args.latency_s)
    recorded_line = (
        f"transitions recorded by the proxy: {recorded} of {calls} calls (warm-up included)"
    )
    print(body, "", *goal_lines, recorded_line, sep="\n")
    pngs = plot(cells, args.img_dir, args.route)
    bullets = [f"- {line}" for line in [*goal_lines, recorded_line]]
    common.append_report(
        args.results,
        f"Proxy overhead, {PATHS[args.route]}",
        "bench.proxy_overhead",
        args,
        [body + "\n", *bullets],
    )
    print("wrote", args.results, *pngs, file=sys.stderr)


if __name__ == "__main__":
    main()
