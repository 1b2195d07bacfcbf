"""Data-parallel steps: one lineage's step on 1 and on N processes (torchrun, gloo on CPUs or
NCCL on GPUs), samples a second per step, the base model replicated on every rank or (with N > 1)
sharded over them (FSDP2, `shard_base`), and how much of the base's weights each rank holds.

Each run launches `--processes` ranks with torchrun; every rank builds the engine on the demo
model (or `--model`), each step deals the same synthetic batch out with `trainer/distributed.
shard` and trains through `Engine.step` (each rank its shard, gradients averaged: the path `flywheel
trainer` takes under a launcher, without Postgres or vLLM). Rank 0 times each step (after a
barrier, so the slowest rank counts). Appends a dated section to bench/data_parallel.md. On this
2-core machine two processes share the cores the one process had: no speed-up is expected; the
figure is for the record, and the GPU figures come from a GPU machine.

    PYTHONPATH=. .venv/bin/python -m bench.data_parallel [--processes 1,2] [--steps 6] [--batch 32]
        [--no-sharded]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).with_suffix(".md")


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    if args.model is None:  # built once, here: every rank reads the same weights
        from demo.tiny_model import build_demo_model

        args.model = build_demo_model(Path(".flywheel/models/demo"))
    rows = []
    counts = [int(p) for p in args.processes.split(",")]
    runs = [(n, False) for n in counts] + [(n, True) for n in counts if n > 1 and args.sharded]
    for processes, sharded in runs:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            command = [
                *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
                *("--nproc_per_node", str(processes), "-m", "bench.data_parallel", "--worker"),
                *("--out", str(out), "--steps", str(args.steps), "--batch", str(args.batch)),
                *("--prompt-tokens", str(args.prompt_tokens)),
                *("--completion-tokens", str(args.completion_tokens)),
                *("--model", str(args.model)),
                *(["--shard-base"] if sharded else []),
            ]
            env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            run = subprocess.run(command, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"{processes} processes failed:\n{run.stderr[-3000:]}")
            measured = json.loads(out.read_text())
        times = measured["times"]
        later = times[1:] or times  # the first step warms up
        median = statistics.median(later)
        held = measured["base_held"] / measured["base_total"]
        base = "sharded" if sharded else "replicated"
        rows.append((processes, base, median, args.batch / median, held))
        print(
            f"{processes} processes, base {base}: step {median:.3f} s, "
            f"{args.batch / median:.1f} samples/s, {held:.0%} of the base's weights a rank"
        )
    report(args, rows)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from trainer.config import TrainerSettings
    from trainer.data.batch import Sample
    from trainer.data.sampling import Sampling
    from trainer.learner.distributed import base_held, end, join, shard
    from trainer.learner.engine import Engine

    world = join()
    home = Path(tempfile.mkdtemp(prefix=f"data-parallel-{world.rank}-"))
    settings = TrainerSettings.model_validate(
        {
            "model": args.model,
            "vllm": ["http://127.0.0.1:9"],
            "adapters_dir": home / "a",
            "home": home,
            "shard_base": args.shard_base,
        }
    )
    engine = Engine(settings)
    vocab = engine.limits.vocab_size
    rng = random.Random(0)

    def sample(i: int) -> Sample:
        p = rng.randint(args.prompt_tokens // 2, args.prompt_tokens)
        c = rng.randint(args.completion_tokens // 2, args.completion_tokens)
        completion = [rng.randrange(3, vocab) for _ in range(c)]
        logprobs = [-math.log(vocab)] * c  # a random model's, near enough
        advantage = 1.0 if i % 2 else -1.0
        prompt = [rng.randrange(3, vocab) for _ in range(p)]
        return Sample(prompt, completion, logprobs, advantage, advantage, Sampling(), 0)

    def wait_for_every_rank() -> None:
        if world.size > 1:
            dist.barrier()

    times = []
    for _ in range(args.steps):
        batch = [sample(i) for i in range(args.batch)]
        wait_for_every_rank()
        started = time.perf_counter()
        engine.step(shard(batch, world))
        wait_for_every_rank()  # the slowest rank's step is the step
        times.append(time.perf_counter() - started)
    held, total = base_held(engine.model)
    if world.leader:
        args.out.write_text(json.dumps({"times": times, "base_held": held, "base_total": total}))
    end()  # leaves the group, skips the interpreter's finalization (trainer/learner/distributed.py)


def report(args: argparse.Namespace, rows: list[tuple[int, str, float, float, float]]) -> None:
    from bench.common import append_section

    load = os.getloadavg()[0]
    lines = [
        f"{os.cpu_count()} CPU cores (load average {load:.1f} at the end); model "
        f"{args.model}; {args.batch} transitions a step, prompts up to "
        f"{args.prompt_tokens} and completions up to {args.completion_tokens} tokens; median "
        f"of {args.steps - 1} steps after the first.\n",
        "| processes | base | median step (s) | samples/s | base weights a rank holds |",
        "|---|---|---|---|---|",
        *(f"| {p} | {b} | {s:.3f} | {r:.1f} | {h:.0%} |" for p, b, s, r, h in rows),
    ]
    append_section(args.results, "Data-parallel steps", "bench.data_parallel", lines)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="a model directory (default: the demo model)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--sharded",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also each count above 1 with the base sharded over the ranks (FSDP2)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard-base", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    main()
