"""The SQL task's agents (demo/sql_agents.py): LangGraph and LangChain's ChatOpenAI through the
real proxy (the fake vLLM answers), each agent recorded under its own name and lineage."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from demo import sql_agents, sql_env


def test_the_three_agents_play_through_the_proxy_each_under_its_own_lineage(
    make_proxy: Any, tmp_path: Path
) -> None:
    proxy = make_proxy(adapter_per_agent="writer,rewriter")
    db = sql_env.build_database(tmp_path / "company.db")

    async def play() -> list[sql_agents.Episode]:
        team = sql_agents.Team(proxy.url, db)
        try:
            return await team.round(questions=2, samples=2, seed=7)
        finally:
            await team.close()

    episodes = asyncio.run(play())
    assert len(episodes) == 4 and [e.failed for e in episodes] == [None] * 4
    for e in episodes:
        # The fake answers nonsense: the checker never says ok, so the rewriter always runs.
        assert e.rewritten and not sql_env.approves(e.verdict)
        assert e.served == {
            "writer": ("0", "writer"),
            "checker": ("0", "policy"),
            "rewriter": ("0", "rewriter"),
        }
        assert e.reward == sql_env.reward(db, e.question, e.final_sql) == 0.0
    rows = proxy.wait_rows(
        "SELECT agent_name, lineage, task_id, credited_at IS NOT NULL FROM transition "
        "ORDER BY requested_at",
        expected=12,
    )
    assert sorted({(a, lineage) for a, lineage, _, _ in rows}) == [
        ("checker", "policy"),
        ("rewriter", "rewriter"),
        ("writer", "writer"),
    ]
    assert {task for _, _, task, _ in rows} == {e.question.task_id for e in episodes}
    assert all(credited for *_, credited in rows)  # the posted final rewards reached every call
    prompts = proxy.query("SELECT count(DISTINCT message_digests) FROM transition")
    assert prompts[0][0] >= 3  # each agent has its own prompt


def test_the_checkers_verdict() -> None:
    assert sql_env.approves(" OK, it answers it")
    assert not sql_env.approves("wrong: it counts cities")
    assert not sql_env.approves("")
