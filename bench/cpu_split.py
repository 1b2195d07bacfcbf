"""Where a call's CPU goes: the load generator, the fake vLLM, Flywheel's proxy and Postgres, per
request, calling the fake directly and through the proxy (interleaved rounds).

On a machine where all four share the cores, throughput through the proxy is roughly
cores / (sum of the four), so this is the budget the proxy's throughput ratio comes from. Run it
with the fake answering token ids and logprobs on every call (the default, as the proxy always
asks for them) and with `--lean-fake` (only when asked, as vLLM does) to see what the extra
answer costs the upstream.

    PYTHONPATH=. .venv/bin/python -m bench.cpu_split [--clients 64] [--seconds 5] [--rounds 2]
        [--lean-fake] [--note "..."]

Prints a table and appends it to bench/cpu_split.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import psutil

from bench import common
from fakes import processes

RESULTS = Path(__file__).with_suffix(".md")
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0, help="per target, per round")
    parser.add_argument("--rounds", type=int, default=2)
    common.add_fake_arguments(parser)
    parser.add_argument("--database-url", help="default: an embedded Postgres (.flywheel/bench)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--note", default="")
    args = parser.parse_args()

    def body(n: int, i: int) -> bytes:
        return common.chat_body(PROMPT, stream=False)

    rows = []
    with common.bench_database(args.database_url) as db_url:
        fake = processes.start_fake(args.latency_s, always_detail=not args.lean_fake)
        flywheel = processes.start_flywheel(fake.url, db_url)
        try:
            groups = {
                "load generator": [psutil.Process()],
                "fake vLLM": common.process_tree(fake.process.pid),
                "proxy": common.process_tree(flywheel.process.pid),
                "Postgres": common.process_tree(common.postgres_pid(db_url)),
            }
            for url in (fake.url, flywheel.url):  # warm-up: connections, caches
                common.load(url + "/v1/chat/completions", body, 8, 0.5)
            for _ in range(args.rounds):
                for target, url in (("direct", fake.url), ("flywheel", flywheel.url)):
                    groups["Postgres"] = common.process_tree(
                        common.postgres_pid(db_url)
                    )  # live backends
                    before = {k: common.cpu_seconds(v) for k, v in groups.items()}
                    started = time.perf_counter()
                    run = common.load(
                        url + "/v1/chat/completions", body, args.clients, args.seconds
                    )
                    wall = time.perf_counter() - started
                    used = {k: common.cpu_seconds(v) - before[k] for k, v in groups.items()}
                    n = max(1, len(run.latencies))
                    rows.append(
                        (
                            target,
                            n / run.elapsed,
                            {k: 1e3 * v / n for k, v in used.items()},
                            sum(used.values()) / wall,
                            run.failed,
                        )
                    )
        finally:
            flywheel.stop()
            fake.stop()

    names = list(rows[0][2])
    lines = [
        "| target | req/s | "
        + " | ".join(f"{k} CPU ms/req" for k in names)
        + " | all four ms/req | cores busy | failed |",
        "|---|---|" + "---|" * (len(names) + 3),
    ]
    for target, rps, per, busy, failed in rows:
        cells = " | ".join(f"{per[k]:.3f}" for k in names)
        lines.append(
            f"| {target} | {rps:,.0f} | {cells} | {sum(per.values()):.3f} | {busy:.2f} | {failed} |"
        )
    table = "\n".join(lines)
    print(table)
    args.note = (
        f"{args.clients} clients; fake: {'lean' if args.lean_fake else 'always detail'}."
        + (f" {args.note}" if args.note else "")
    )
    common.append_report(args.results, "CPU per call by process", "bench.cpu_split", args, [table])


if __name__ == "__main__":
    main()
