"""Multi-turn storage (issue 16): bytes stored per episode, and the writer's CPU per call, with
prompts' token ids stored whole in each row (before) and in content-addressed blocks (now).

Episodes: 20 calls each, a 6,000-token system prompt and document, each call's prompt the
previous one plus its 100-token answer and a 5-token next message, so the last is ~8,000 tokens
(the issue's "20-turn, 8k-context episode"); messages grow alike. The calls of all episodes are
written turn by turn, one `transitions.insert_transitions` per turn (a writer's batch), with a
writer's cache of what it has stored. "whole" writes them the way the store did before blocks (the
prompt's ids all in the row: the same code with `split_blocks` cutting nothing); the bytes are
what the tables, TOAST and indexes grew by (`transition`'s partitions, `message`,
`token_block`), per episode. CPU: this process's, per call, around the writes (packing, hashing,
COPY encoding; Postgres's own work is not in it) at this benchmark's batches (one per turn: as
many calls as episodes), and for ~4,000-token prompts in batches of 100.

    PYTHONPATH=. .venv/bin/python -m bench.storage [--episodes 40] [--cpu-episodes 100]
        [--database-url URL]

Prints the table and appends it to bench/storage.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg

from bench.common import append_section, bench_database
from core import codecs, database, retention
from core.record import TransitionRecord
from proxy.record.store import transitions

RESULTS = Path(__file__).with_suffix(".md")
TURNS, START, ANSWER, NEXT = 20, 6_000, 100, 5
TABLES = ("transition", "message", "token_block")


def episode(rng: random.Random, start: int = START) -> list[TransitionRecord]:
    episode_id = f"st-{uuid.uuid4().hex[:12]}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You read the document and answer. " * 400}
    ]
    prompt = [rng.randrange(150_000) for _ in range(start)]
    records = []
    for turn in range(TURNS):
        messages = [*messages, {"role": "user", "content": f"question {turn}"}]
        answer = [rng.randrange(150_000) for _ in range(ANSWER)]
        records.append(
            TransitionRecord(
                id=str(uuid.uuid4()),
                episode_id=episode_id,
                request_id=str(uuid.uuid4()),
                choice_index=0,
                task_id="doc",
                agent_name="reader",
                requested_at=time.time(),
                route="chat",
                status="ok",
                http_status=200,
                model_requested="policy",
                model_used="policy-v1",
                policy_version=1,
                lineage="policy",
                messages=list(messages),
                params={"model": "policy", "max_tokens": ANSWER},
                prompt_token_ids=list(prompt),
                completion_token_ids=answer,
                logprobs=[-rng.random() for _ in answer],
                text="answer " * 30,
                finish_reason="stop",
                latency_ms=40.0,
                prompt_tokens=len(prompt),
                completion_tokens=len(answer),
            )
        )
        messages = [*messages, {"role": "assistant", "content": "answer " * 30}]
        prompt = [*prompt, *answer, *(rng.randrange(150_000) for _ in range(NEXT))]
    return records


def whole(packed: bytes | None, known: Any = None) -> tuple[list[bytes], list[bytes], bytes | None]:
    """The store before blocks: the whole prompt in its row."""
    return [], [], packed


@dataclass
class Result:
    mode: str
    episodes: int
    calls: int
    prompt_ids: int
    bytes_by_table: dict[str, int]
    cpu_s: float

    @property
    def per_episode(self) -> float:
        return sum(self.bytes_by_table.values()) / self.episodes


def sizes(url: str) -> dict[str, int]:
    """Bytes on disk of each of TABLES (`transition`: every partition), indexes included."""
    engine, _ = database.create_sessions(url)
    try:
        grown = retention.sizes(engine)
    finally:
        engine.dispose()
    return {t: grown[t] for t in TABLES}


async def write(url: str, episodes: list[list[TransitionRecord]]) -> float:
    """Every episode's turn t in one batch, turn by turn, as a writer would: CPU seconds."""
    engine, sessionmaker = database.create_async_sessions(url)
    known: set[bytes] = set()
    memo = codecs.PromptMemo()  # as the writer keeps them: what it sent, each episode's prompt
    cpu = 0.0
    try:
        for turn in range(len(episodes[0])):
            batch = [e[turn] for e in episodes]
            started = time.process_time()
            async with sessionmaker.begin() as session:
                sent = await transitions.insert_transitions(
                    batch, session=session, gamma=None, stored=known, memo=memo
                )
            known.update(sent)
            cpu += time.process_time() - started
    finally:
        await engine.dispose()
    return cpu


def run(url: str | None, mode: str, episodes: list[list[TransitionRecord]]) -> Result:
    split: Callable[..., Any] = whole if mode == "whole" else codecs.split_blocks
    with bench_database(url) as db, mock.patch.object(transitions, "split_blocks", split):
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        before = sizes(db)
        cpu = asyncio.run(write(db, episodes))
        after = sizes(db)
    calls = sum(len(e) for e in episodes)
    prompt_ids = sum(len(r.prompt_token_ids or ()) for e in episodes for r in e)
    grown = {t: after[t] - before[t] for t in TABLES}
    return Result(mode, len(episodes), calls, prompt_ids, grown, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--cpu-episodes", type=int, default=100, help="for the 4k-prompt CPU")
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--results", type=Path, default=RESULTS, help="report to append to")
    args = parser.parse_args()

    rng = random.Random(0)
    episodes = [episode(rng) for _ in range(args.episodes)]
    results = [run(args.database_url, mode, episodes) for mode in ("whole", "blocks", "whole")]
    # ~4,000-token prompts alone (the first five calls of 100 episodes starting at 3,500 ids,
    # batches of 100 as under load, so that a batch's fixed cost does not hide a row's): CPU.
    short = [episode(rng, start=3_500)[:5] for _ in range(args.cpu_episodes)]
    cpu4k: dict[str, list[float]] = {}
    for mode in ("whole", "blocks", "whole", "blocks"):
        r = run(args.database_url, mode, short)
        cpu4k.setdefault(mode, []).append(r.cpu_s / r.calls)

    lines = [
        f"{args.episodes} episodes of {TURNS} calls; prompts {START:,} to "
        f"{START + (TURNS - 1) * (ANSWER + NEXT):,} token ids "
        f"({results[0].prompt_ids / results[0].calls:,.0f} a call on average).\n",
        "| prompts stored | transition | message | token_block | per episode | per call | "
        "writer CPU ms/call |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b = r.bytes_by_table
        lines.append(
            f"| {r.mode} | {b['transition'] / 2**20:,.1f} MiB | {b['message'] / 2**20:,.1f} MiB"
            f" | {b['token_block'] / 2**20:,.1f} MiB | {r.per_episode / 2**10:,.0f} KiB"
            f" | {r.per_episode / TURNS / 2**10:,.1f} KiB | {r.cpu_s / r.calls * 1e3:.2f} |"
        )
    naive = min(r.per_episode for r in results if r.mode == "whole")
    blocks = next(r.per_episode for r in results if r.mode == "blocks")
    lines.append(f"\nPer episode: **{naive / blocks:.1f}x smaller** with blocks.\n")
    lines.append(
        "Writer CPU per call at ~4,000-token prompts (batches of 100, the first five calls of "
        "episodes starting at 3,500 ids), two runs each: "
        + ", ".join(f"{m} {', '.join(f'{v * 1e3:.3f}' for v in vs)} ms" for m, vs in cpu4k.items())
    )
    print("\n".join(lines))
    append_section(args.results, "Multi-turn storage", "bench.storage", lines)


if __name__ == "__main__":
    main()
