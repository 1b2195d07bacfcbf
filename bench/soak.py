"""The soak: steady traffic for an hour; the proxy's memory, file descriptors, connections and
writer memo should stay flat, and everything acknowledged should be stored.

    PYTHONPATH=. .venv/bin/python -m bench.soak [--minutes 60] [--clients 8] [--pause-s 0.1]
        [--sample-s 60] [--warmup-s 300] [--flat-ratio 1.2]

The stack and the traffic of bench/chaos.py (episodes of two chat calls and a reward, against
two fake vLLM replicas and a Postgres of its own), with a pause between each client's episodes
for a steady rate. Every `--sample-s` the proxy process's RSS, open file descriptors (/proc/PID/fd)
and TCP connections, Postgres's client connections, and the writer memo's size (the proxy's
`flywheel_writer_memo_bytes`) are sampled. Flat: after `--warmup-s`, each
figure's largest sample is at most `--flat-ratio` times its smallest (fds other than TCP
connections, and Postgres connections: or within 4 of it); the RSS trend is printed beside.
Prints the samples and the verdict, appends them to bench/soak.md.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import psycopg

from bench import common
from bench.chaos import Traffic, lost, stack
from fakes import processes

RESULTS = Path(__file__).with_suffix(".md")
SLACK = 4  # fds and connections: a few more or fewer than the smallest sample is still flat


@dataclass
class Sample:
    at_s: float
    rss_mib: float
    fds: int
    tcp: int
    postgres: int
    memo: float  # the writer memo's MiB (flywheel_writer_memo_bytes)
    calls: int


def sample(at_s: float, pid: int, url: str, db: str, calls: int) -> Sample:
    p = psutil.Process(pid)
    with psycopg.connect(db) as conn:  # (this connection is not counted)
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return Sample(
        at_s,
        p.memory_info().rss / 2**20,
        p.num_fds(),
        len(p.net_connections()),
        int(row[0]),
        common.metric(url, "flywheel_writer_memo_bytes") / 2**20,
        calls,
    )


def flat(values: list[float], ratio: float, slack: float = 0.0) -> tuple[bool, str]:
    low, high = min(values), max(values)
    ok = high <= low * ratio or high - low <= slack
    return ok, f"{low:g}..{high:g}"


def trend(points: list[tuple[float, float]]) -> float:
    """The least-squares slope (per second): a short run's ratio can hide a steady climb."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


def verdict(samples: list[Sample], warmup_s: float, ratio: float) -> tuple[bool, list[str]]:
    after = [s for s in samples if s.at_s > warmup_s] or samples[-1:]
    checks = {
        "RSS MiB": flat([round(s.rss_mib, 1) for s in after], ratio),
        # (sockets to the clients come and go with their keep-alive pools: the rest may not)
        "fds other than TCP connections": flat([s.fds - s.tcp for s in after], ratio, SLACK),
        "Postgres connections": flat([s.postgres for s in after], ratio, SLACK),
    }
    checks["writer memo"] = flat([s.memo for s in after], ratio)
    lines = [
        f"{name} {span}: {'flat' if ok else 'NOT flat'}" for name, (ok, span) in checks.items()
    ]
    lines.append(f"RSS trend {trend([(x.at_s, x.rss_mib) for x in after]) * 3600:+.0f} MiB/h")
    return all(ok for ok, _ in checks.values()), lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--pause-s", type=float, default=0.1)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=300.0, help="samples before: not judged")
    parser.add_argument("--flat-ratio", type=float, default=1.2, help="max/min after warm-up")
    parser.add_argument("--note")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = processes.WORK / "soak"
    work.mkdir(parents=True, exist_ok=True)
    samples: list[Sample] = []
    with stack(work) as s:
        assert s.proxy is not None
        traffic = Traffic(s.url, args.clients, pause_s=args.pause_s).start()
        started = time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(args.sample_s)
            at = time.monotonic() - started
            samples.append(sample(at, s.proxy.process.pid, s.url, s.pg.url, traffic.calls))
            x = samples[-1]
            print(
                f"{x.at_s:6.0f} s  RSS {x.rss_mib:6.1f} MiB  fds {x.fds:4d}  tcp {x.tcp:4d}  "
                f"postgres {x.postgres:3d}  memo {x.memo:.2f} MiB  "
                f"calls {x.calls}",
                flush=True,
            )
        traffic.stop()
        missing_t, missing_r = lost(s.pg.url, traffic, set())
    seconds = samples[-1].at_s
    ok, checks = verdict(samples, args.warmup_s, args.flat_ratio)
    lines = [
        f"{args.clients} clients, {args.pause_s:g} s between a client's episodes, "
        f"{seconds / 60:.1f} min, a sample every {args.sample_s:g} s; fake vLLM 5 ms x 2 "
        "replicas." + (f" {args.note}" if args.note else ""),
        "",
        "| s | proxy RSS MiB | open fds | TCP connections | Postgres connections | memo MiB "
        "| calls so far |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {x.at_s:.0f} | {x.rss_mib:.1f} | {x.fds} | {x.tcp} | {x.postgres} "
            f"| {x.memo:.2f} | {x.calls} |"
            for x in samples
        ),
        "",
        f"After {args.warmup_s:g} s of warm-up (flat: max <= {args.flat_ratio:g} x min; fds and "
        f"connections also within {SLACK}): {'; '.join(checks)}. "
        + ("FLAT." if ok else "NOT FLAT."),
        f"{traffic.calls / seconds:.0f} calls/s; acknowledged {len(traffic.transitions)} "
        f"transitions and {len(traffic.rewards)} rewards, missing from Postgres: {missing_t} and "
        f"{missing_r}; clients told otherwise: {dict(traffic.errors) or 'nothing'}.",
    ]
    print("\n".join(lines))
    common.append_section(args.results, "Soak", "bench.soak", lines)


if __name__ == "__main__":
    main()
