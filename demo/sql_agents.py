"""The SQL task's three agents (issue 12), orchestrated with LangGraph as a user would write them:
each is a LangChain `ChatOpenAI` on `model="policy"` whose only change is the base URL pointing
at Flywheel, and whose `X-Agent-Name` says who it is.

    writer    question -> a SQLite query
    checker   question, query, what the query returned -> "ok" or "wrong"    (not trained)
    rewriter  question, query, what it returned, the checker's "wrong" -> a new query

The graph: write -> run the query -> check -> (ok: done | wrong: rewrite -> done). The episode's
reward is the execution match of its final query (demo/sql_env.py), posted as the final reward;
Flywheel credits it to every call of the episode, and each lineage's trainer (writer, rewriter)
trains on its own agent's calls. The checker's calls go to the default lineage: with no trainer
on it, the base model. Every call's `X-Policy-Version` and `X-Policy-Lineage` are kept, to show
which adapter served which agent.

    python -m demo.sql_agents --base-url http://127.0.0.1:8000 --rounds 10
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from openai import DefaultAsyncHttpxClient

from demo import sql_env
from demo.rounds import command_line, print_line
from demo.sql_env import approves, checker_messages, rewriter_messages, writer_messages
from flywheel.client import AsyncFlywheel, FlywheelError, tag_client

TEMPERATURE = 1.0  # any works (docs/off_policy.md); 1.0 explores most for the demo
MAX_TOKENS = 48
AGENTS = ("writer", "checker", "rewriter")


class State(TypedDict, total=False):
    question: str
    writer_sql: str
    sql: str  # the query as it stands (the writer's, then the rewriter's)
    result: str  # what the query returned, as the checker and the rewriter see it
    verdict: str
    rewritten: bool


@dataclass
class Episode:
    question: sql_env.Question
    writer_sql: str
    verdict: str
    final_sql: str
    reward: float
    rewritten: bool
    # agent -> (X-Policy-Version, X-Policy-Lineage) of its call
    served: dict[str, tuple[str, str]] = field(default_factory=dict)
    failed: str | None = None  # a call or the reward post that did not succeed


class Team:
    """The three agents on one proxy, one database; `play` runs one episode."""

    def __init__(self, base_url: str, database: Path, *, api_key: str = "unused") -> None:
        self.base_url = base_url.rstrip("/")
        self.database = database
        self.api_key = api_key
        self._flywheel = AsyncFlywheel(self.base_url, api_key, timeout=120)
        # One model per agent, shared by every episode: each call's tags come from the episode
        # (and the agent) open where it is made, through the hooks of this httpx client.
        self._http = tag_client(DefaultAsyncHttpxClient())
        self._models = {a: self._model() for a in AGENTS}

    async def close(self) -> None:
        await self._http.aclose()
        await self._flywheel.aclose()

    def _model(self) -> ChatOpenAI:
        return ChatOpenAI(
            model="policy",
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key,  # type: ignore[arg-type]
            temperature=TEMPERATURE,
            max_completion_tokens=MAX_TOKENS,
            max_retries=0,
            include_response_headers=True,
            http_async_client=self._http,
        )

    async def play(self, question: sql_env.Question) -> Episode:
        episode = self._flywheel.episode(
            question.task_id, episode_id=f"sql-{uuid.uuid4().hex[:12]}"
        )
        served: dict[str, tuple[str, str]] = {}

        async def ask(agent: str, messages: list[tuple[str, str]]) -> str:
            chat = [SystemMessage(m) if r == "system" else HumanMessage(m) for r, m in messages]
            async with episode.agent(agent):  # this call is `agent`'s, in the same episode
                answer = await self._models[agent].ainvoke(chat)
            headers = answer.response_metadata.get("headers", {})
            served[agent] = (
                headers.get("x-policy-version", "?"),
                headers.get("x-policy-lineage", "?"),
            )
            return str(answer.content)

        async def write(state: State) -> State:
            sql = await ask("writer", writer_messages(state["question"]))
            return {"writer_sql": sql, "sql": sql, "result": sql_env.run(self.database, sql).text()}

        async def check(state: State) -> State:
            verdict = await ask(
                "checker", checker_messages(state["question"], state["sql"], state["result"])
            )
            return {"verdict": verdict}

        async def rewrite(state: State) -> State:
            sql = await ask(
                "rewriter", rewriter_messages(state["question"], state["sql"], state["result"])
            )
            return {"sql": sql, "rewritten": True}

        graph = StateGraph(State)
        graph.add_node("write", write)
        graph.add_node("check", check)
        graph.add_node("rewrite", rewrite)
        graph.add_edge(START, "write")
        graph.add_edge("write", "check")
        graph.add_conditional_edges(
            "check", lambda s: END if approves(s["verdict"]) else "rewrite", ["rewrite", END]
        )
        graph.add_edge("rewrite", END)
        try:
            final = await graph.compile().ainvoke({"question": question.text})
        except Exception as e:  # a failed call: the episode ends unrewarded, and says so
            return Episode(question, "", "", "", 0.0, False, served, failed=repr(e))
        value = sql_env.reward(self.database, question, final["sql"])
        played = Episode(
            question,
            writer_sql=final["writer_sql"],
            verdict=final["verdict"],
            final_sql=final["sql"],
            reward=value,
            rewritten=bool(final.get("rewritten")),
            served=served,
        )
        try:
            await self._flywheel.reward(value, episode_id=episode.id, idempotency_key="final")
        except FlywheelError as e:
            played.failed = f"reward: {e}"
        return played

    async def round(self, questions: int = 8, samples: int = 8, *, seed: int) -> list[Episode]:
        """`questions` questions, each played `samples` times at once (a GRPO group each)."""
        drawn = sql_env.questions(questions, seed=seed)
        return list(await asyncio.gather(*(self.play(q) for q in drawn for _ in range(samples))))


def print_round(r: int, episodes: list[Episode]) -> None:
    rewritten = sum(e.rewritten for e in episodes) / len(episodes)
    served = sorted({f"{a}:{v}" for e in episodes for a, (v, _) in e.served.items()})
    failed = sum(1 for e in episodes if e.failed)
    details = f"rewritten {rewritten:.2f}", f"served {' '.join(served)}"
    print_line(r, [e.reward for e in episodes], failed, *details)


def run(
    base_url: str,
    rounds: int | None,  # None: until interrupted
    database: Path,
    report: Callable[[int, list[Episode]], None] = print_round,
    *,
    seed: int = 0,
) -> list[Episode]:
    async def go() -> list[Episode]:
        team = Team(base_url, database)
        history: list[Episode] = []
        try:
            rng = random.Random(seed)
            r = 0
            while rounds is None or r < rounds:
                r += 1
                episodes = await team.round(seed=rng.randrange(2**31))
                report(r - 1, episodes)
                history += episodes
        finally:
            await team.close()
        return history

    return asyncio.run(go())


def _args(argv: list[str] | None = None) -> Any:
    parser = command_line(__doc__.splitlines()[0], rounds=10)
    parser.add_argument("--database", type=Path)
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = _args()
    run(args.base_url, args.rounds, args.database or sql_env.default_database())
