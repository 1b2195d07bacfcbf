"""The soak: steady traffic for minutes; the proxy's memory, file descriptors and connections
should stay flat, and everything acknowledged should be stored.

    PYTHONPATH=. .venv/bin/python -m bench.soak [--minutes 10] [--clients 8] [--pause-s 0.1]

The stack and the traffic of bench/chaos.py (episodes of two chat calls and a reward, against
two fake vLLM replicas and a Postgres of its own), with a pause between each client's episodes
for a steady rate. Every `--sample-s` the proxy process's RSS, open file descriptors and TCP
connections, and Postgres' connections, are sampled. Prints the samples and the drift (last
minute against the first), appends them to bench/soak.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import psutil
import psycopg

from bench import common
from bench.chaos import Traffic, lost, stack
from fakes import processes

RESULTS = Path(__file__).with_suffix(".md")


def memo_mib(url: str) -> float:
    """The writer's prompt memo, as the proxy reports it (flywheel_writer_memo_bytes)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("flywheel_writer_memo_bytes "):
            return float(line.split()[1]) / 2**20
    return float("nan")


def sample(pid: int, db: str) -> tuple[float, int, int, int]:
    """(RSS MiB, open fds, TCP connections, Postgres connections)."""
    p = psutil.Process(pid)
    with psycopg.connect(db) as conn:  # (this connection is not counted)
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return p.memory_info().rss / 2**20, p.num_fds(), len(p.net_connections()), int(row[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--pause-s", type=float, default=0.1)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--note")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = processes.WORK / "soak"
    work.mkdir(parents=True, exist_ok=True)
    samples: list[tuple[float, float, int, int, int, float, int]] = []
    with stack(work) as s:
        assert s.proxy is not None
        traffic = Traffic(s.url, args.clients, pause_s=args.pause_s).start()
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < args.minutes * 60:
            time.sleep(args.sample_s)
            rss, fds, tcp, pg = sample(s.proxy.process.pid, s.pg.url)
            memo = memo_mib(s.url)
            samples.append((elapsed + args.sample_s, rss, fds, tcp, pg, memo, traffic.calls))
            print(
                f"{samples[-1][0]:6.0f} s  RSS {rss:6.1f} MiB  fds {fds:4d}  tcp {tcp:4d}  "
                f"postgres {pg:3d}  memo {memo:5.1f} MiB  calls {traffic.calls}",
                flush=True,
            )
        traffic.stop()
        missing_t, missing_r = lost(s.pg.url, traffic, set())
    seconds = samples[-1][0]
    lines = [
        f"{args.clients} clients, {args.pause_s:g} s between a client's episodes, "
        f"{seconds / 60:.1f} min; fake vLLM 5 ms x 2 replicas."
        + (f" {args.note}" if args.note else ""),
        "",
        "| s | proxy RSS MiB | open fds | TCP connections | Postgres connections | memo MiB "
        "| calls so far |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {t:.0f} | {rss:.1f} | {fds} | {tcp} | {pg} | {memo:.2f} | {calls} |"
            for t, rss, fds, tcp, pg, memo, calls in samples
        ),
        "",
        f"{traffic.calls / seconds:.0f} calls/s; RSS {samples[0][1]:.1f} -> {samples[-1][1]:.1f} "
        f"MiB (first sample to last), fds {samples[0][2]} -> {samples[-1][2]}; acknowledged "
        f"{len(traffic.transitions)} transitions and {len(traffic.rewards)} rewards, "
        f"missing from Postgres: {missing_t} and {missing_r}; clients told otherwise: "
        f"{dict(traffic.errors) or 'nothing'}.",
    ]
    print("\n".join(lines))
    common.append_section(args.results, "Soak", "bench.soak", lines)


if __name__ == "__main__":
    main()
