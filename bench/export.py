"""`flywheel export` at a million transitions: rows per second and peak memory, per format.

Fills a fresh database with `--transitions` rows shaped like recorded chat calls
(bench/synthetic.py: 4 an episode; a shared system message and the task's question by digest, so the
calls of one task and agent form a group for `pairs`; 300 prompt token ids, 12 completion ids and
logprobs each; a step reward on one call in four), then runs each export in a process of its own
(`python -m flywheel export`), sampling its resident memory:

    PYTHONPATH=. .venv/bin/python -m bench.export [--transitions 1000000]
        [--database-url URL] [--results bench/export.md]

Memory that does not grow with the table is the point: the rows stream from a server-side
cursor and Parquet is written a row group at a time. The figures are appended to bench/export.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import synthetic
from bench.common import append_section, bench_database
from bench.synthetic import CALLS_PER_EPISODE, COMPLETION_IDS, PROMPT_IDS

REPORT = Path(__file__).with_name("export.md")


def run_export(url: str, out: Path, *args: str) -> tuple[int, float, float, float, int]:
    """(rows, export seconds, process seconds, peak RSS MiB, file bytes) of one `flywheel
    export` process (its own figure: the export, without the interpreter's start and imports)."""
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": url}
    cmd = [sys.executable, "-m", "flywheel", "export", str(out), *args]
    started = time.perf_counter()
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    watched = psutil.Process(process.pid)
    peak = 0
    while process.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    stdout = process.stdout.read() if process.stdout else ""
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {stdout}")
    words = stdout.split()  # "N <kind> rows to PATH in S s (R/s)"
    rows, exported = int(words[0]), float(words[words.index("in") + 1])
    return rows, exported, seconds, peak / 2**20, out.stat().st_size


CASES = [
    ("transitions, JSON Lines", "t.jsonl", ()),
    ("transitions + tokens, JSON Lines", "tt.jsonl", ("--tokens",)),
    ("transitions + tokens, Parquet", "tt.parquet", ("--tokens",)),
    ("sft, Parquet", "sft.parquet", ("--kind", "sft")),
    ("pairs, JSON Lines", "pairs.jsonl", ("--kind", "pairs")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transitions", type=int, default=1_000_000)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--results", type=Path, default=REPORT)
    args = parser.parse_args()
    results = []
    with bench_database(args.database_url) as url, tempfile.TemporaryDirectory() as tmp:
        synthetic.fill(url, args.transitions // CALLS_PER_EPISODE)
        # The export's memory at a tenth of the rows: what grows with the table would show.
        small = [("transitions + tokens, Parquet, first 10 %", "small.parquet", ("--tokens",))]
        until = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - 0.9 * 86400))
        for name, file, extra in [*CASES, *small]:
            more = ("--until", until) if file == "small.parquet" else ()
            rows, seconds, wall, peak, size = run_export(url, Path(tmp) / file, *extra, *more)
            results.append((name, rows, seconds, wall, peak, size))
            rate = rows / (seconds or wall)  # the command prints tenths: a tiny export says 0.0
            print(
                f"{name:45s} {rows:>9,} rows {seconds:6.1f} s {rate:>9,.0f}/s "
                f"(process {wall:5.1f} s) peak RSS {peak:6.0f} MiB  {size / 2**20:7.0f} MiB"
            )
    lines = [
        f"{args.transitions:,} transitions ({args.transitions // CALLS_PER_EPISODE:,} episodes, "
        f"{PROMPT_IDS} prompt ids and {COMPLETION_IDS} completion ids each); one `flywheel "
        "export` process per row, peak RSS sampled every 50 ms (includes the interpreter and "
        "imports).\n",
        "| export | rows | export s | rows/s | process s | peak RSS MiB | file MiB |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {n} | {r:,} | {s:.1f} | {r / (s or w):,.0f} | {w:.1f} | {p:.0f} | {b / 2**20:.0f} |"
            for n, r, s, w, p, b in results
        ],
    ]
    append_section(args.results, "flywheel export", "bench.export", lines)


if __name__ == "__main__":
    main()
