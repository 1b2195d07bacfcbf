"""Recording rate: transitions per second the proxy's background writer puts into Postgres.

Realistic rows (fakes/traffic.py): multi-turn agent episodes whose prompts repeat their history
(a long system prompt, growing messages, prompt token ids growing with them), completions with ids
and logprobs. The records go through the same `Recorder` the proxy uses (batching, message
de-duplication, credit); afterwards every row is counted, so "nothing lost" is checked, not
assumed. Goal (issue 5): >= 10,000 transitions/s sustained.

    .venv/bin/python -m bench.recording_rate [--transitions 20000] [--concurrent 256] [--repeat 3]
        [--plot docs/img/recording_rate.png] [--database-url URL]

Prints the figures (also the writer's and Postgres's CPU per transition, steadier than rates on a
shared machine) and appends a line per run to bench/recording_rate.md.

First figures (2-core machine, embedded Postgres 18, 1,020-token prompts, 10-call episodes):
3,200-4,400 transitions/s with text COPY through a temporary table. Now (binary COPY straight into
the table, two writers, uncompressed token ids, memoised digests; see docs/benchmarks.md):
15-16k/s with episodes one after another, ~10k/s with 256 interleaved, warm; nothing lost.
What remains in the profile: packing token ids from Python lists, COPY formatting, and Postgres's
own heap/TOAST/index/WAL work (~45 us a transition).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client import REGISTRY

from bench import storage
from bench.common import bench_database
from core import database, embedded
from core.record import TransitionRecord
from fakes.traffic import episode_records
from proxy.record.journal import Journal
from proxy.record.recorder import Recorder

RESULTS = Path(__file__).with_suffix(".md")  # this script's own report
RECORDED = "flywheel_transitions_recorded_total"


def backend_cpu_s(url: str) -> float | None:
    """CPU seconds the Postgres backends serving `url` have used so far (this machine only)."""
    with psycopg.connect(url) as conn:
        pids = [
            pid
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            )
        ]
    try:  # utime and stime: fields 14 and 15, counted after the ")" that ends the name
        stats = [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() for pid in pids]
    except OSError:  # a remote Postgres
        return None
    return sum(int(f[11]) + int(f[12]) for f in stats) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    elapsed_s: float
    writer_cpu_s: float  # this process: the Recorder, psycopg, SQLAlchemy
    gc_cpu_s: float  # of which in the garbage collector's collections (a generation-2 pass
    # costs ~20 µs/transition here; whether one falls inside a run shifts run to run)
    postgres_cpu_s: float | None  # the backends that wrote (None: not on this machine)
    curve: list[tuple[float, int]]  # (seconds, transitions stored so far)


async def measure(url: str, records: list[TransitionRecord], batch_size: int) -> Run:
    engine, sessions = database.create_async_sessions(url)
    with tempfile.TemporaryDirectory() as journal_dir:
        recorder = Recorder(
            sessions,
            Journal(Path(journal_dir)),
            batch_size=batch_size,
            queue_max_bytes=2**40,
            retry_s=1.0,
            gamma=None,
        )
        recorder.start()
        before, curve = recorded(), list[tuple[float, int]]()
        started, cpu_started = time.perf_counter(), time.process_time()
        sampler = asyncio.create_task(sample_stored(started, before, curve))
        with gc_seconds() as gc_s:
            for i in range(0, len(records), 100):  # arriving in bursts, as from many clients
                recorder.submit(records[i : i + 100])
                await asyncio.sleep(0)
            for episode_id in {r.episode_id: None for r in records}:
                assert await recorder.wait_stored(episode_id, timeout=600), "not stored in time"
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        sampler.cancel()
        curve.append((elapsed, recorded() - before))
        postgres_cpu = backend_cpu_s(url)  # the pool's connections opened during the run
        journaled = recorder.journal.pending
        await recorder.stop()
    await engine.dispose()
    assert journaled == 0, f"{journaled} transitions went to the journal: Postgres failed"
    return Run(elapsed, cpu, gc_s[0], postgres_cpu, curve)


@contextlib.contextmanager
def gc_seconds() -> Iterator[list[float]]:
    """CPU seconds spent in garbage collections while the block runs (in [0] once it ends)."""
    spent, started = [0.0], [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.process_time()
        else:
            spent[0] += time.process_time() - started[0]

    gc.callbacks.append(callback)
    try:
        yield spent
    finally:
        gc.callbacks.remove(callback)


def recorded() -> int:
    """Transitions the recorder has committed so far (its own Prometheus counter)."""
    return int(REGISTRY.get_sample_value(RECORDED, {"status": "ok"}) or 0)


async def sample_stored(started: float, before: int, curve: list[tuple[float, int]]) -> None:
    while True:
        curve.append((time.perf_counter() - started, recorded() - before))
        await asyncio.sleep(0.02)


def plot(runs: list[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(runs):
        seconds, stored = zip(*[(0.0, 0), *run.curve], strict=True)
        rate = run.curve[-1][1] / run.elapsed_s
        ax.plot(seconds, stored, label=f"run {i + 1}: {rate:,.0f}/s")
    end = max(run.elapsed_s for run in runs)
    ax.plot([0, end], [0, 10_000 * end], "k--", linewidth=1, label="goal: 10,000/s")
    ax.set(xlabel="seconds", ylabel="transitions stored (counted)", title=title)
    ax.set_ylim(0, max(run.curve[-1][1] for run in runs) * 1.1)
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transitions", type=int, default=20_000)
    parser.add_argument("--turns", type=int, default=10, help="calls per episode")
    parser.add_argument(
        "--concurrent",
        type=int,
        default=1,
        help="episodes in flight: their calls interleave, as from concurrent agents",
    )
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=1, help="runs, each on a fresh database")
    parser.add_argument("--database-url", help="default: an embedded Postgres in a temp dir")
    parser.add_argument("--results", type=Path, default=RESULTS, help="report to append to")
    parser.add_argument("--plot", type=Path, help="also draw stored-over-time to this PNG")
    args = parser.parse_args()

    base = args.database_url or embedded.url(Path(tempfile.mkdtemp()))
    if not args.results.exists():
        args.results.write_text(
            "# Recording rate (appended by bench/recording_rate.py)\n\n" + TABLE_HEADER
        )
    # Each run records new traffic (only the system prompt is the same), so no run finds the
    # writer's caches warm with its own rows.
    runs = [one_run(base, traffic(run, args), args) for run in range(args.repeat)]
    if args.plot:
        title = f"{args.transitions:,} transitions, {args.concurrent} episode(s) at once"
        plot(runs, args.plot, title)


def traffic(seed: int, args: Any) -> list[TransitionRecord]:
    rng = random.Random(seed)
    records: list[TransitionRecord] = []
    while len(records) < args.transitions:
        episodes = [episode_records(rng, args.turns) for _ in range(args.concurrent)]
        records += [r for turn in zip(*episodes, strict=True) for r in turn]
    return records[: args.transitions]


TABLE_HEADER = (
    "| when | transitions | turns/episode | concurrent episodes | mean prompt tokens | batch | "
    "seconds | per second | stored | bytes/transition | writer CPU µs/transition | "
    "Postgres CPU µs/transition |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def one_run(base: str, records: list[TransitionRecord], args: Any) -> Run:
    prompt_tokens = sum(len(r.prompt_token_ids or ()) for r in records) / len(records)
    with bench_database(base) as url:
        run = asyncio.run(measure(url, records, args.batch_size))
        with psycopg.connect(url) as conn:
            stored = conn.execute("SELECT count(*) FROM transition").fetchone()[0]  # type: ignore[index]
        size = sum(storage.sizes(url).values())  # every partition, messages, token blocks

    n = len(records)
    rate = n / run.elapsed_s
    writer_us = f"{run.writer_cpu_s / n * 1e6:.0f}"
    postgres_us = "-" if run.postgres_cpu_s is None else f"{run.postgres_cpu_s / n * 1e6:.0f}"
    line = (
        f"| {time.strftime('%Y-%m-%d %H:%M')} | {n} | {args.turns} | {args.concurrent} | "
        f"{prompt_tokens:.0f} | {args.batch_size} | {run.elapsed_s:.2f} | {rate:,.0f} | {stored} | "
        f"{size / n:,.0f} | {writer_us} | {postgres_us} |"
    )
    print(
        f"recorded {stored}/{n} transitions in {run.elapsed_s:.2f} s: {rate:,.0f}/s "
        f"(mean prompt {prompt_tokens:.0f} tokens; {size / n:,.0f} bytes/transition "
        "on disk incl. indexes and shared messages; CPU per transition: writer "
        f"{writer_us} µs (GC {run.gc_cpu_s / n * 1e6:.0f}), Postgres {postgres_us} µs)"
    )
    if stored != n:
        raise SystemExit(f"LOST {n - stored} transitions")
    with args.results.open("a") as f:
        f.write(line + "\n")
    return run


if __name__ == "__main__":
    main()
