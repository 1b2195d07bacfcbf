"""The tool-using demo agent: an OpenAI Agents SDK agent, with the SDK's default model (the
Responses API), whose only change is its client's base URL pointing at Flywheel.

Each episode asks "What is a op b op c?" (demo/calc_tools.py). The agent has one function tool,
`calculator(expression)`; the SDK runs the multi-turn loop itself: the model calls the tool, the
SDK runs it and sends the result back, the model answers. Each model call is one transition; all
of an episode's calls carry its id (`X-Episode-Id`), and its question is the task (the GRPO
group). When the run is over the agent posts, in one all-or-nothing list, the final reward (1 for
the right number) and, for a tool run that failed (an expression the calculator cannot read), an
intermediate reward of FAILED_TOOL_RUN with source "tool", named by the tool call's id. The proxy
adds its own AIR penalties for calls it can judge from the wire (an undeclared tool, arguments
that break the schema, a call vLLM could not parse).

    python -m demo.tool_agent --base-url http://127.0.0.1:8000 --rounds 40
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    RunConfig,
    Runner,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.tool_context import ToolContext
from openai import APIError, DefaultAsyncHttpxClient

from demo.calc_tools import (
    INSTRUCTIONS,
    STRICT,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_PARAMETERS,
    evaluate,
    questions,
    reward,
    task_id,
)
from demo.rounds import command_line, print_line
from flywheel.client import AsyncFlywheel, FlywheelError, Reward

TEMPERATURE = 1.0  # any works (docs/off_policy.md); 1.0 explores most for the demo
MAX_TOKENS = 48  # a call is ~25 tokens; a cut answer fails the SDK's run
MAX_TURNS = 3  # call, answer, and one more chance
FAILED_TOOL_RUN = -0.5  # the step reward for a call the calculator could not run
AGENT_NAME = "calculator-agent"


@dataclass
class EpisodeState:
    """The run's context (the SDK hands it to the tool): what the tool saw."""

    episode_id: str
    valid_calls: int = 0  # calls the calculator could run
    failed_calls: list[str] = field(default_factory=list)  # their tool call ids


@dataclass(frozen=True)
class Episode:
    episode_id: str
    task_id: str
    reward: float
    valid_call: bool  # the calculator ran on a readable expression at least once
    turns: int  # model calls made
    policy_version: str
    error: str | None = None  # the SDK gave up on the run (a tool it does not know, ...)
    failed: str | None = None  # a request that did not succeed (the e2e test wants none)


async def _calculate(ctx: ToolContext[Any], arguments: str) -> str:
    state: EpisodeState = ctx.context
    try:
        expression = orjson.loads(arguments).get("expression")
    except (orjson.JSONDecodeError, AttributeError):
        expression = None
    value = evaluate(expression) if isinstance(expression, str) else None
    if value is None:
        state.failed_calls.append(ctx.tool_call_id)
        return "error: expected an expression like 3 + 4 * 2"
    state.valid_calls += 1
    return str(value)


CALCULATOR = FunctionTool(
    name=TOOL_NAME,
    description=TOOL_DESCRIPTION,
    params_json_schema=TOOL_PARAMETERS,
    on_invoke_tool=_calculate,
    # Not strict: vLLM would then hold the call to the schema while decoding (demo/calc_tools.py).
    strict_json_schema=STRICT,
)


class ToolAgent:
    def __init__(self, base_url: str, *, concurrency: int = 16, seed: int = 0) -> None:
        self.base_url = base_url.rstrip("/")
        self._versions: dict[str, str] = {}  # episode id -> policy version of its first call
        self._turns: dict[str, int] = {}
        self._flywheel = AsyncFlywheel(self.base_url)  # rewards, retried; tags from its episodes
        self._openai = self._flywheel.openai(
            max_retries=0,
            timeout=120,
            http_client=DefaultAsyncHttpxClient(event_hooks={"response": [self._seen]}),
        )
        set_tracing_disabled(True)
        set_default_openai_client(self._openai, use_for_tracing=False)
        self._agent: Agent[EpisodeState] = Agent(
            name=AGENT_NAME, instructions=INSTRUCTIONS, model="policy", tools=[CALCULATOR]
        )
        self._limit = asyncio.Semaphore(concurrency)
        self._rng = random.Random(seed)
        self._questions = questions()

    async def close(self) -> None:
        await self._openai.close()
        await self._flywheel.aclose()

    async def _seen(self, response: Any) -> None:  # an httpx2.Response (openai's httpx)
        episode = response.request.headers.get("x-episode-id")
        if episode is not None:
            self._versions.setdefault(episode, response.headers.get("x-policy-version", "?"))
            self._turns[episode] = self._turns.get(episode, 0) + 1

    async def round(self, *, questions: int = 8, samples: int = 8) -> list[Episode]:
        chosen = self._rng.sample(self._questions, questions)
        jobs = [q for q in chosen for _ in range(samples)]
        return list(await asyncio.gather(*(self.episode(q) for q in jobs)))

    async def episode(self, question: str) -> Episode:
        state = EpisodeState(f"tools-{uuid.uuid4().hex[:12]}")
        task = task_id(question)
        settings = ModelSettings(temperature=TEMPERATURE, max_tokens=MAX_TOKENS)
        error = failed = None
        score = 0.0
        async with self._limit, self._flywheel.episode(task, AGENT_NAME, state.episode_id):
            try:
                result = await Runner.run(
                    self._agent,
                    question,
                    context=state,
                    max_turns=MAX_TURNS,
                    run_config=RunConfig(model_settings=settings, tracing_disabled=True),
                )
                score = reward(str(result.final_output), question)
            except APIError as e:  # a request failed: not the model's doing, no reward
                failed = repr(e)
            except Exception as e:  # the SDK gave up on the run (an unknown tool, a cut answer)
                error = f"{type(e).__name__}: {e}"
            if failed is None:
                failed = await self._post_rewards(state, score)
        return Episode(
            state.episode_id,
            task,
            score,
            valid_call=state.valid_calls > 0,
            turns=self._turns.pop(state.episode_id, 0),
            policy_version=self._versions.pop(state.episode_id, "?"),
            error=error,
            failed=failed,
        )

    async def _post_rewards(self, state: EpisodeState, score: float) -> str | None:
        """The failed tool runs' step rewards and the final one, all or nothing (each with its
        own key: the client's retries store them once)."""
        steps = [
            Reward(
                state.episode_id,
                FAILED_TOOL_RUN,
                tool_call_id=call_id,
                source="tool",
                idempotency_key=f"{state.episode_id}:{call_id}",
            )
            for call_id in state.failed_calls
        ]
        final = Reward(state.episode_id, score, idempotency_key=state.episode_id)
        try:
            await self._flywheel.rewards([*steps, final])
        except FlywheelError as e:
            return repr(e)
        return None


def run(
    base_url: str, rounds: int | None, report: Callable[[int, list[Episode]], None]
) -> list[Episode]:
    async def main() -> list[Episode]:
        agent = ToolAgent(base_url)
        history: list[Episode] = []
        try:
            r = 0
            while rounds is None or r < rounds:
                episodes = await agent.round()
                history += episodes
                report(r, episodes)
                r += 1
        finally:
            await agent.close()
        return history

    return asyncio.run(main())


def print_round(r: int, episodes: list[Episode]) -> None:
    valid = sum(e.valid_call for e in episodes) / len(episodes)
    versions = sorted({e.policy_version for e in episodes})
    failed = sum(e.failed is not None for e in episodes)
    details = f"valid tool calls {valid:.2f}", f"policy v{','.join(versions)}"
    print_line(r, [e.reward for e in episodes], failed, *details)


if __name__ == "__main__":
    args = command_line(__doc__.split("\n\n")[0]).parse_args()
    run(args.base_url, args.rounds, print_round)
