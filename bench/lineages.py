"""Many lineages in one trainer: memory and step time with 1, 4 and 16 lineages over one base
model (`flywheel trainer --lineages`, trainer/loop.py `build_trainers`), against one process per
lineage (today's other way: the base model once per process).

Each count runs in a fresh process (so its memory is its own): the demo model, one `Engine` per
lineage (the second and later `beside` the first: a PEFT adapter each, an optimizer state each,
a TRL trainer object each), then `--steps` steps of every lineage in turn on a batch shaped like
the demo's (8 rows, a 20-token prompt, 8 completion tokens), the behaviour log-probs those of the
current weights. It reports the resident memory after the engines are built and at its peak
(VmHWM), seconds per step, and what one process per lineage would hold (N x the 1-lineage
figure). Goal (issue 32): 16 lineages in <= 1.3x the memory of one.

    .venv/bin/python -m bench.lineages [--counts 1,4,16] [--steps 3] [--model demo|calculator]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_suffix(".md")


def measure(count: int, steps: int, model_dir: Path) -> dict[str, float]:
    """In this process: `count` lineages' engines on one base, each stepped `steps` times."""
    import torch

    from trainer.config import TrainerSettings
    from trainer.data.batch import Sample
    from trainer.data.sampling import Sampling
    from trainer.learner.engine import Engine

    def rss_mib(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(field)

    torch.set_num_threads(1)
    before = rss_mib("VmRSS")
    with tempfile.TemporaryDirectory() as home:
        values: dict[str, Any] = {"model": model_dir, "vllm": ["http://127.0.0.1:9"]}
        settings = TrainerSettings(**values, adapters_dir=Path(home), home=Path(home))
        started = time.perf_counter()
        first = Engine(settings)
        engines = [first] + [first.beside(settings, f"lineage{i}", None) for i in range(1, count)]
        build_s = time.perf_counter() - started
        built = rss_mib("VmRSS")
        rng = random.Random(0)
        vocab = first.limits.vocab_size

        def batch(engine: Engine) -> list[Sample]:
            rows = []
            for i in range(8):
                prompt = [rng.randrange(3, vocab) for _ in range(20)]
                completion = [rng.randrange(3, vocab) for _ in range(8)]
                ids = torch.tensor([prompt + completion])
                with torch.no_grad():
                    engine._use()
                    logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
                logps = torch.log_softmax(logits.float(), -1)
                behaviour = logps.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()
                advantage = 1.0 if i % 2 else -1.0
                rows.append(
                    Sample(prompt, completion, behaviour, advantage, advantage, Sampling(), 0)
                )
            return rows

        times = []
        for _ in range(steps):
            for engine in engines:  # in turn, as run_in_turn steps them
                samples = batch(engine)
                t = time.perf_counter()
                engine.step(samples)
                times.append(time.perf_counter() - t)
    return {
        "lineages": count,
        "rss_before_mib": before,
        "rss_built_mib": built,
        "rss_peak_mib": rss_mib("VmHWM"),
        "build_s": build_s,
        "step_s": sorted(times)[len(times) // 2],
        "steps": len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,4,16")
    parser.add_argument("--steps", type=int, default=3, help="steps of each lineage")
    parser.add_argument("--model", choices=["demo", "calculator"], default="demo")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure this count
    args = parser.parse_args()
    model_dir = model(args.model)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.steps, model_dir)))
        return
    rows = []
    for count in (int(c) for c in args.counts.split(",")):
        command = ["-m", "bench.lineages", "--one", str(count), "--steps", str(args.steps)]
        child = subprocess.run(
            [sys.executable, *command, "--model", args.model],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    report(rows, args)


def model(name: str) -> Path:
    """The model directory, built on first use (both builders are idempotent)."""
    from fakes.processes import WORK

    if name == "calculator":
        from demo.calculator import build_calculator_model

        return build_calculator_model(WORK / "models" / "calculator")
    from demo.tiny_model import build_demo_model

    return build_demo_model(WORK / "models" / "demo")


def report(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    one = next((r for r in rows if r["lineages"] == 1), rows[0])
    lines = [
        f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.lineages "
        f"--counts {args.counts} --steps {args.steps} --model {args.model}`\n",
        "| lineages | RSS built (MiB) | RSS peak (MiB) | peak / 1 lineage | one process each "
        "(MiB, N x 1) | median step (s) | build (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r["lineages"]
        lines.append(
            f"| {n:.0f} | {r['rss_built_mib']:.0f} | {r['rss_peak_mib']:.0f} | "
            f"{r['rss_peak_mib'] / one['rss_peak_mib']:.2f}x | {n * one['rss_peak_mib']:.0f} | "
            f"{r['step_s']:.3f} | {r['build_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not RESULTS.exists():
        RESULTS.write_text(
            "# Many lineages in one trainer (bench/lineages.py)\n\n"
            + __doc__.split("\n\n", 1)[1].split("    .venv")[0]
        )
    with RESULTS.open("a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
