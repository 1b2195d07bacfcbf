"""Judge throughput: episodes a second `flywheel judge` scores (judge/), through litellm, against a
judge model answering after `--latency-s`, with a proxy taking its rewards.

    PYTHONPATH=. .venv/bin/python -m bench.judge [--episodes 800] [--group-size 8]
        [--concurrency 1,4,16] [--latency-s 0,1] [--database-url URL] [--results bench/judge.md]
        [--venv DIR]

For each latency and concurrency: a fresh database holding `--episodes` unrewarded episodes of 4
calls (bench/synthetic.py: 50 tasks, two messages and an answer a call, over the last day), a proxy,
the fake vLLM as the judge model (`--judge-answers`: scores that fit the judge's JSON schema, as
vLLM's guided decoding gives them), and `flywheel judge` in its own install (fakes/processes.py's
litellm venv: litellm with openai 2) running until every episode has its judge reward. Reported:
episodes judged a second, judge calls a second, the judge process's CPU per call, and the rewards
stored with source `judge` (all of them, or the run says what is missing).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import psutil
import psycopg

from bench import common, synthetic
from bench.common import append_section, bench_database
from bench.synthetic import CALLS_PER_EPISODE, TASKS
from fakes import processes

REPORT = Path(__file__).with_name("judge.md")


def judged(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM reward WHERE source = 'judge'").fetchone()
    return int(row[0]) if row else 0


def one_run(
    url: str, venv: Path, episodes: int, group_size: int, concurrency: int, latency_s: float
) -> tuple[float, int, float, int]:
    """(seconds until every episode was judged, judge calls, judge CPU seconds, rewards)."""
    fake = processes.start_fake(latency_s, always_detail=False, judge_answers=True)
    proxy = processes.start_flywheel(fake.url, url)
    env = {
        **os.environ,
        "FLYWHEEL_DATABASE_URL": url,
        "FLYWHEEL_JUDGE_MODEL": "openai/demo",
        "FLYWHEEL_JUDGE_API_BASE": fake.url + "/v1",
        "FLYWHEEL_JUDGE_API_KEY": "sk-bench",
        "FLYWHEEL_JUDGE_PROXY": proxy.url,
        "FLYWHEEL_JUDGE_KEY": common.MASTER_KEY,
        "FLYWHEEL_JUDGE_GRACE_S": "0",
        # bench/synthetic.py spreads episodes over the last day: a task's lone newest episodes
        # would otherwise wait judge_alone_after_s for company, and the run for them.
        "FLYWHEEL_JUDGE_ALONE_AFTER_S": "0",
        "FLYWHEEL_JUDGE_POLL_S": "0.2",
        "FLYWHEEL_JUDGE_GROUP_SIZE": str(group_size),
        "FLYWHEEL_JUDGE_CONCURRENCY": str(concurrency),
        "FLYWHEEL_LOG_LEVEL": "warning",
    }
    judge = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "flywheel", "judge"],
        env=env,
        cwd=Path(__file__).parents[1],
    )
    try:
        meter = psutil.Process(judge.pid)
        while judged(url) == 0 and judge.poll() is None:  # litellm's import, then the first
            time.sleep(0.05)
        cpu_start = sum(meter.cpu_times()[:2])
        started = time.perf_counter()
        while (n := judged(url)) < episodes and judge.poll() is None:
            if time.perf_counter() - started > 600:
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - started
        cpu = sum(meter.cpu_times()[:2]) - cpu_start
    finally:
        judge.terminate()
        judge.wait(timeout=30)
        proxy.stop()
        fake.stop()
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(DISTINCT group_id) FROM judgement").fetchone()
    calls = int(row[0]) if row else 0
    return seconds, calls, cpu, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=800)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--latency-s", default="0,1")
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--results", type=Path, default=REPORT)
    parser.add_argument(
        "--venv", type=Path, default=processes.WORK / "litellm-venv", help="built here"
    )
    args = parser.parse_args()
    venv = processes.build_litellm_venv(args.venv)
    lines = [
        f"{args.episodes} unrewarded episodes of {CALLS_PER_EPISODE} calls over {TASKS} tasks, "
        f"groups of up to {args.group_size}; the fake vLLM as judge model, through litellm. "
        "Timed from the first reward stored (after litellm's import) to the last.\n",
        "| judge latency s | concurrency | episodes/s | judge calls/s | judge CPU ms/call |"
        " rewards stored |",
        "|---|---|---|---|---|---|",
    ]
    for latency in (float(x) for x in args.latency_s.split(",")):
        for concurrency in (int(x) for x in args.concurrency.split(",")):
            with bench_database(args.database_url) as url:
                synthetic.fill(url, args.episodes, rewarded=0.0)
                seconds, calls, cpu, n = one_run(
                    url, venv, args.episodes, args.group_size, concurrency, latency
                )
            line = (
                f"| {latency:g} | {concurrency} | {n / seconds:,.1f} | {calls / seconds:,.2f} | "
                f"{1000 * cpu / max(calls, 1):.1f} | {n:,} of {args.episodes:,} |"
            )
            print(line, flush=True)
            lines.append(line)
    append_section(args.results, "Judge throughput", "bench.judge", lines)


if __name__ == "__main__":
    main()
