"""The learner's step on a real model's batches: seconds and peak memory of one GRPO step and one
supervised step of SmolLM2-135M-Instruct on BFCL-shaped batches, with and without the prompts'
shared parts forwarded once (trainer/learner/shared_prompts.py), whole or in micro-batches.

A GRPO batch is 4 training-part questions x 8 sampled answers (BFCL's prompts, ~460 tokens, 254
of them the same system preamble; answers of `--answer-tokens` sampled tokens); a supervised
batch is 8 questions with their demonstrated answers. Each configuration runs in a process of its
own (its peak resident memory is its own), the step timed after one warm-up step.

    .venv/bin/python -m bench.learner_step [--threads 1] [--answer-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.common import append_section

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
CONFIGS = [  # (kind, share_prompts, micro_batch_tokens)
    # whole and unshared, a GRPO batch needs ~1.8 MB of activations a token: 21.7 GB, killed
    ("grpo", False, 8192),
    ("grpo", True, 8192),
    ("grpo", True, 0),
    ("sft", False, 0),
    ("sft", True, 0),
]


def one(kind: str, share: bool, budget: int, threads: int, answer_tokens: int) -> dict[str, float]:
    """Runs in its own process: build the engine, take a warm-up step and a timed one."""
    import random

    import torch
    from transformers import AutoTokenizer

    from demo import bfcl
    from trainer.config import TrainerSettings
    from trainer.data.batch import Sample
    from trainer.data.sampling import Sampling
    from trainer.learner.engine import Engine
    from trainer.learner.sft import Demo
    from trainer.models import resolve

    torch.set_num_threads(threads)
    model_dir = resolve("smollm2-135m", ROOT / ".flywheel")
    settings = TrainerSettings.model_validate(
        dict(
            model=model_dir,
            vllm=["http://127.0.0.1:1"],
            adapters_dir=ROOT / ".flywheel" / "learner-step",
            home=ROOT / ".flywheel" / "learner-step",
            lora_rank=16,
            lora_alpha=32,
            share_prompts=share,
            micro_batch_tokens=budget,
            metrics_port=0,
        )
    )
    engine = Engine(settings)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, _ = bfcl.split(bfcl.load())
    rng = random.Random(0)

    def prompt_ids(q: bfcl.Question) -> list[int]:
        text = tokenizer.apply_chat_template(
            bfcl.prompt(q), add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def answer_ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def grpo_batch(questions: list[bfcl.Question]) -> list[Sample]:
        return [
            Sample(
                prompt_ids=prompt_ids(q),
                completion_ids=[rng.randrange(1000, 40000) for _ in range(answer_tokens)],
                logprobs=[-1.0] * answer_tokens,
                advantage=rng.uniform(-1, 1),
                reward=0.0,
                sampling=Sampling(temperature=1.0),
                staleness=0,
            )
            for q in questions
            for _ in range(8)
        ]

    def sft_batch(questions: list[bfcl.Question]) -> list[Demo]:
        return [
            Demo(prompt_ids(q), [*answer_ids(bfcl.demonstration(q)), tokenizer.eos_token_id])
            for q in questions
        ]

    seconds = []
    for _ in range(2):
        questions = rng.sample(train, 4 if kind == "grpo" else 8)
        started = time.perf_counter()
        if kind == "grpo":
            engine.step(grpo_batch(questions))
        else:
            engine.sft_step(sft_batch(questions))
        seconds.append(time.perf_counter() - started)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": round(seconds[-1], 1), "peak_mb": round(peak_mb)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # kind,share,budget: the child's job
    args = parser.parse_args()
    if args.one:
        kind, share, budget = args.one.split(",")
        out = one(kind, share == "1", int(budget), args.threads, args.answer_tokens)
        print(json.dumps(out))
        return
    lines = [
        f"SmolLM2-135M-Instruct, LoRA r16 on every projection, {args.threads} torch thread(s), "
        f"GRPO answers of {args.answer_tokens} tokens; one step after a warm-up, each in a "
        "process of its own.\n",
        "| step | prompts' shared parts once | micro-batch tokens | seconds | peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    for kind, share, budget in CONFIGS:
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.learner_step",
                "--one",
                f"{kind},{int(share)},{budget}",
                "--threads",
                str(args.threads),
                "--answer-tokens",
                str(args.answer_tokens),
            ],
            capture_output=True,
            text=True,
            check=True,
            env=os.environ | {"OMP_NUM_THREADS": str(args.threads)},
        )
        result = json.loads(child.stdout.strip().splitlines()[-1])
        batch = "4 x 8 samples" if kind == "grpo" else "8 demonstrations"
        shared = "yes" if share else "no"
        row = (
            f"| {kind} ({batch}) | {shared} | {budget or 'whole'} | {result['seconds']} | "
            f"{result['peak_mb']} |"
        )
        print(row, flush=True)
        lines.append(row)
    append_section(
        RESULTS, "The learner's step on a real model", "bench.learner_step", [*lines, ""]
    )


if __name__ == "__main__":
    main()
