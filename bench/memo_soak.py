"""The writer's prompt memo under one-call episodes (issue 31, item 2): its RSS should go flat once
its bound is reached, and the bytes it accounts should follow what it holds.

    PYTHONPATH=. .venv/bin/python -m bench.memo_soak [--calls 50000] [--sample-every 5000]

Each call is an episode of its own (a fresh id, as the proxy gives a call without X-Episode-Id),
its prompt one of five shapes in turn: chat with string content and a long system prompt, chat
with list content and an image, a completions prompt string, a Responses input (instructions and
typed items), a short chat prompt. Each prompt is parsed afresh from JSON (as the proxy parses a
request) and goes through a real `PromptMemo` the way the writer's store does
(proxy/record/store/transitions.py): message digests, token blocks, remember. Every
`--sample-every` calls: this process's RSS (which includes the bounded cache of message
digests, core/codecs.py `MEMO_SIZE`), the memo's accounted bytes and entries. Prints the
table and appends it to bench/memo_soak.md.
"""

from __future__ import annotations

import argparse
import random
import uuid
from pathlib import Path

import psutil

from bench.common import append_section
from core import codecs
from fakes.traffic import PROMPT_SHAPES, one_call_prompt, through_memo

RESULTS = Path(__file__).with_suffix(".md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--sample-every", type=int, default=5_000)
    parser.add_argument(
        "--shapes", default=",".join(PROMPT_SHAPES), help="comma-separated, in turn"
    )
    parser.add_argument(
        "--tokens", type=int, default=600, help="prompt token ids (a short prompt has 12)"
    )
    parser.add_argument("--max-bytes", type=int, default=codecs.PROMPT_MEMO_BYTES)
    parser.add_argument("--max-entries", type=int, default=codecs.PROMPT_MEMO_ENTRIES)
    parser.add_argument("--note")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    rng, me = random.Random(31), psutil.Process()
    memo = codecs.PromptMemo(args.max_bytes, args.max_entries)
    start = me.memory_info().rss / 2**20
    samples: list[tuple[int, float, float, int]] = []
    print(f"{'calls':>7}  {'RSS MiB':>8}  {'memo MiB':>8}  {'entries':>7}", flush=True)
    for n in range(1, args.calls + 1):
        messages, ids = one_call_prompt(shapes[n % len(shapes)], rng, n, args.tokens)
        through_memo(memo, f"ep-{uuid.uuid4().hex}", messages, ids)
        if n % args.sample_every == 0 or n == args.calls:
            rss = me.memory_info().rss / 2**20
            samples.append((n, rss, memo.nbytes / 2**20, len(memo)))
            print(f"{n:7d}  {rss:8.1f}  {memo.nbytes / 2**20:8.1f}  {len(memo):7d}", flush=True)
    half = samples[len(samples) // 2]
    lines = [
        f"{args.calls:,} one-call episodes, shapes {', '.join(shapes)} in turn, "
        f"{args.tokens} prompt token ids each (short: 12); "
        f"the memo bounded to {args.max_bytes / 2**20:g} MiB and {args.max_entries:,} entries."
        + (f" {args.note}" if args.note else ""),
        "",
        "| calls | RSS MiB | memo accounted MiB | memo entries |",
        "|---:|---:|---:|---:|",
        *(f"| {n} | {rss:.1f} | {acc:.1f} | {entries} |" for n, rss, acc, entries in samples),
        "",
        f"RSS {start:.1f} MiB before the first call, {half[1]:.1f} at {half[0]:,} calls, "
        f"{samples[-1][1]:.1f} at {samples[-1][0]:,} (second half: "
        f"{samples[-1][1] - half[1]:+.1f} MiB).",
    ]
    print("\n".join(lines))
    append_section(args.results, "Prompt memo soak", "bench.memo_soak", lines)


if __name__ == "__main__":
    main()
