"""The demo agent: an ordinary openai-python program that only points its base URL at Flywheel.

Each round asks `questions` calculator questions `samples` times each; every attempt is its own
episode, tagged with the question as its task (so the attempts form a GRPO group), and gets a
reward of 1 or 0 posted as soon as the answer is checked.

    python -m demo.agent --base-url http://127.0.0.1:8000 --rounds 40
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from demo.calculator import QUESTIONS, messages, reward, task_id
from demo.rounds import command_line, print_line
from flywheel.client import Flywheel

TEMPERATURE = 1.0  # any works (docs/off_policy.md); 1.0 explores most for the demo
MAX_TOKENS = 8


@dataclass(frozen=True)
class Episode:
    episode_id: str
    task_id: str
    reward: float
    policy_version: str
    failed: str | None = None  # the error, for a request that did not succeed
    answer: str = ""  # what the model said


class Agent:
    def __init__(
        self,
        base_url: str,
        *,
        concurrency: int = 8,
        seed: int = 0,
        api_key: str | None = None,
        score: Callable[[str, int, int], float] = reward,  # what this application rewards
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._flywheel = Flywheel(self.base_url, api_key)
        self._score = score
        self._openai = self._flywheel.openai(max_retries=0)
        self._pool = ThreadPoolExecutor(concurrency)
        self._rng = random.Random(seed)

    def close(self) -> None:
        self._pool.shutdown()
        self._openai.close()
        self._flywheel.close()

    def round(self, *, questions: int = 8, samples: int = 8) -> list[Episode]:
        chosen = self._rng.sample(QUESTIONS, questions)
        jobs = [(a, b) for a, b in chosen for _ in range(samples)]
        return list(self._pool.map(lambda q: self.episode(*q), jobs))

    def episode(self, a: int, b: int) -> Episode:
        episode_id, task = f"calc-{uuid.uuid4().hex[:12]}", task_id(a, b)
        try:
            with self._flywheel.episode(task, "calculator", episode_id):  # tags every call
                raw = self._openai.chat.completions.with_raw_response.create(
                    model="policy",
                    messages=messages(a, b),  # type: ignore[arg-type]
                    max_tokens=MAX_TOKENS,
                    temperature=TEMPERATURE,
                )
                answer = raw.parse().choices[0].message.content or ""
                score = self._score(answer, a, b)
                self._flywheel.reward(score, idempotency_key=episode_id)  # retried if need be
        except Exception as e:  # counted, never hidden: the e2e test asserts there are none
            return Episode(episode_id, task, 0.0, "?", failed=repr(e))
        version = raw.headers.get("x-policy-version", "?")
        return Episode(episode_id, task, score, version, answer=answer)


def run(
    base_url: str, rounds: int | None, report: Callable[[int, list[Episode]], None]
) -> list[Episode]:
    agent = Agent(base_url)
    history: list[Episode] = []
    try:
        r = 0
        while rounds is None or r < rounds:
            episodes = agent.round()
            history += episodes
            report(r, episodes)
            r += 1
    finally:
        agent.close()
    return history


def print_round(r: int, episodes: list[Episode]) -> None:
    versions = sorted({e.policy_version for e in episodes})
    failed = sum(e.failed is not None for e in episodes)
    rewards = [e.reward for e in episodes]
    print_line(r, rewards, failed, f"policy v{','.join(versions)}", width=40)


if __name__ == "__main__":
    args = command_line(__doc__.split("\n\n")[0]).parse_args()
    played = run(args.base_url, args.rounds, print_round)
    if played and all(e.failed for e in played):  # a one-shot service (docker-compose.cpu.yml)
        raise SystemExit(f"every call failed, e.g. {played[0].failed}")
