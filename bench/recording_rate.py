"""Recording rate: transitions per second the proxy's background writer puts into Postgres.

Realistic rows: multi-turn agent episodes whose prompts repeat their history (a long system prompt,
growing messages, prompt token ids growing with them), completions with ids and logprobs. The
records go through the same `Recorder` the proxy uses (batching, message de-duplication, credit);
afterwards every row is counted, so "nothing lost" is checked, not assumed. Goal (issue 5):
>= 10,000 transitions/s sustained.

    .venv/bin/python -m bench.recording_rate [--transitions 20000] [--database-url URL]

Prints the figures and appends a line to bench/recording_rate.md.

First figures (2-core machine, embedded Postgres 18, 1,020-token prompts, 10-call episodes):
3,200-4,000 transitions/s, nothing lost, ~6.3 kB per transition on disk; short of the goal.
Batches now go in with COPY (through a temporary table, so replays stay idempotent): 3.2k -> 3.8k/s.
What remains in the profile: Postgres's own time (indexes, TOAST), text-format COPY escaping of
the bytea columns (binary COPY is the next step), and packing (issue 5).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from proxy import database
from proxy.journal import Journal
from proxy.recorder import Recorder

SYSTEM = "You are a careful assistant that uses tools. " * 25  # ~1.1 kB, shared by every call
RESULTS = Path(__file__).with_suffix(".md")  # this script's own report


def episode_records(rng: random.Random, turns: int) -> list[dict[str, Any]]:
    """One agent episode: each call's prompt repeats the whole history so far."""
    episode_id, task_id = f"bench-{uuid.uuid4().hex[:12]}", f"task-{rng.randrange(1000)}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    prompt_ids = [rng.randrange(50_000) for _ in range(300)]
    records = []
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"step {turn}: " + "data " * 40}]
        completion = [rng.randrange(50_000) for _ in range(100)]
        records.append(
            {
                "id": str(uuid.uuid4()),
                "episode_id": episode_id,
                "request_id": str(uuid.uuid4()),
                "choice_index": 0,
                "task_id": task_id,
                "agent_name": "bench",
                "requested_at": time.time(),
                "route": "chat",
                "status": "ok",
                "http_status": 200,
                "model_requested": "policy",
                "model_used": "base",
                "policy_version": 0,
                "messages": messages,
                "params": {"model": "policy", "max_tokens": 128},
                "prompt_token_ids": prompt_ids,
                "completion_token_ids": completion,
                "logprobs": [-rng.random() for _ in completion],
                "text": "ok " * 60,
                "tool_calls": None,
                "finish_reason": "stop",
                "latency_ms": 50.0,
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion),
            }
        )
        messages = [*messages, {"role": "assistant", "content": "ok " * 60}]
        prompt_ids = prompt_ids + completion + [rng.randrange(50_000) for _ in range(60)]
    return records


async def measure(url: str, records: list[dict[str, Any]], batch_size: int) -> float:
    engine = database.create_engine(url)
    with tempfile.TemporaryDirectory() as journal_dir:
        recorder = Recorder(
            database.create_sessionmaker(engine),
            Journal(Path(journal_dir)),
            batch_size=batch_size,
            queue_max=10 * len(records),
            retry_s=1.0,
            gamma=None,
        )
        recorder.start()
        started = time.perf_counter()
        for i in range(0, len(records), 100):  # arriving in bursts, as from many clients
            recorder.submit(records[i : i + 100])
            await asyncio.sleep(0)
        episodes = {r["episode_id"] for r in records}
        for episode_id in episodes:
            assert await recorder.wait_stored(episode_id, timeout=600), "not stored in time"
        elapsed = time.perf_counter() - started
        journaled = recorder.journal.pending
        await recorder.stop()
    await engine.dispose()
    assert journaled == 0, f"{journaled} transitions went to the journal: Postgres failed"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transitions", type=int, default=20_000)
    parser.add_argument("--turns", type=int, default=10, help="calls per episode")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--database-url", help="default: an embedded Postgres in a temp dir")
    parser.add_argument("--results", type=Path, default=RESULTS, help="report to append to")
    args = parser.parse_args()

    rng = random.Random(0)
    records: list[dict[str, Any]] = []
    while len(records) < args.transitions:
        records += episode_records(rng, args.turns)
    records = records[: args.transitions]
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in records) / len(records)

    base = args.database_url or database.embedded_postgres_url(Path(tempfile.mkdtemp()))
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = database.with_database(base, name)
    try:
        database.migrate(url)
        elapsed = asyncio.run(measure(url, records, args.batch_size))
        with psycopg.connect(url) as conn:
            stored = conn.execute("SELECT count(*) FROM transition").fetchone()[0]  # type: ignore[index]
            size = conn.execute(
                "SELECT pg_total_relation_size('transition') + pg_total_relation_size('message')"
            ).fetchone()[0]  # type: ignore[index]
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    rate = len(records) / elapsed
    line = (
        f"| {time.strftime('%Y-%m-%d %H:%M')} | {len(records)} | {args.turns} | "
        f"{prompt_tokens:.0f} | {args.batch_size} | {elapsed:.2f} | {rate:,.0f} | {stored} | "
        f"{size / len(records):,.0f} |"
    )
    print(
        f"recorded {stored}/{len(records)} transitions in {elapsed:.2f} s: {rate:,.0f}/s "
        f"(mean prompt {prompt_tokens:.0f} tokens; {size / len(records):,.0f} bytes/transition "
        "on disk incl. indexes and shared messages)"
    )
    if stored != len(records):
        raise SystemExit(f"LOST {len(records) - stored} transitions")
    if not args.results.exists():
        args.results.write_text(
            "# Recording rate (appended by bench/recording_rate.py)\n\n"
            "| when | transitions | turns/episode | mean prompt tokens | batch | seconds | "
            "per second | stored | bytes/transition |\n|---|---|---|---|---|---|---|---|---|\n"
        )
    with args.results.open("a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
