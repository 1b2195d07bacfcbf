"""The BFCL agent: an ordinary openai-python program asking Berkeley Function Calling Leaderboard
questions (demo/bfcl.py) through Flywheel, with BFCL's own prompt and answer format.

- Once, first: the training part's demonstrations (each question's possible answer written as
  the call BFCL asks for) are posted for the trainer's warm start (POST /v1/demonstrations).
- Each round: `questions` training-part questions, `samples` episodes each (the question is the
  task: the samples form a GRPO group); each answer is checked by BFCL's AST check and rewarded:
  1 for a valid call, else 0 (`--reward binary`) or the partial credit (`--reward partial`:
  0.25 parsable, 0.5 the right function, 0.75 the right parameter names).
- Every `eval_every` new versions: the held-out part is asked at temperature 0 through
  `policy@N` (agent `bfcl-eval`, never rewarded: never trained on), its accuracy and parsable
  share reported beside the training reward.

    python -m demo.bfcl_agent --base-url http://127.0.0.1:8000 --rounds 40
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Literal

from demo.bfcl import Question, demonstration, load, prompt, split
from demo.rounds import command_line, print_line
from flywheel.client import Demonstration, Flywheel

TEMPERATURE = 1.0
MAX_TOKENS = 128  # the longest answer of simple_python is 84 tokens; prose runs on
AGENT, EVAL_AGENT = "bfcl", "bfcl-eval"
Reward = Literal["binary", "partial"]


@dataclass(frozen=True)
class Answer:
    question: str
    text: str
    valid: bool
    parsable: bool
    partial: float
    reward: float  # what was posted
    policy_version: str
    failed: str | None = None
    episode_id: str = ""


@dataclass(frozen=True)
class Evaluation:
    version: int  # the policy version asked (policy@N; 0: the base model)
    accuracy: float  # BFCL's verdict: valid answers / questions
    parsable: float
    questions: int
    answers: list[Answer] = field(default_factory=list, repr=False)


class BfclAgent:
    def __init__(
        self,
        base_url: str,
        *,
        reward: Reward = "binary",
        category: str = "simple_python",
        concurrency: int = 16,
        seed: int = 0,
        temperature: float = TEMPERATURE,
        api_key: str | None = None,
    ) -> None:
        self.train, self.held_out = split(load(category))
        self._reward = reward
        self._temperature = temperature
        self._flywheel = Flywheel(base_url.rstrip("/"), api_key)
        self._openai = self._flywheel.openai(max_retries=0)
        self._pool = ThreadPoolExecutor(concurrency)
        self._rng = random.Random(seed)

    def close(self) -> None:
        # Ctrl-C while a round or the held-out part is in flight: stop now, not after it.
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._openai.close()
        self._flywheel.close()

    def post_demonstrations(self, questions: Sequence[Question] | None = None) -> int:
        """The training part's answers as demonstrations (posting them again adds none)."""
        items = [
            Demonstration(
                prompt(q),
                demonstration(q),
                agent=AGENT,
                task_id=q.id,
                idempotency_key=f"bfcl-demo-{q.id}",
            )
            for q in (self.train if questions is None else questions)
        ]
        return sum(
            r.status == "created"
            for start in range(0, len(items), 500)
            for r in self._flywheel.demonstrations(items[start : start + 500])
        )

    def round(
        self, *, questions: int = 4, samples: int = 8, pool: Sequence[Question] | None = None
    ) -> list[Answer]:
        """`questions` drawn from `pool` (default: the training part), `samples` episodes each."""
        chosen = self._rng.sample(list(self.train if pool is None else pool), questions)
        jobs = [q for q in chosen for _ in range(samples)]
        return list(self._pool.map(self.episode, jobs))

    def episode(self, q: Question) -> Answer:
        episode_id = f"bfcl-{uuid.uuid4().hex[:12]}"
        try:
            with self._flywheel.episode(q.id, AGENT, episode_id):
                text, version = self._ask(q, "policy", self._temperature)
                verdict = q.score(text)
                reward = 1.0 if verdict.valid else 0.0
                if self._reward == "partial":
                    reward = verdict.partial
                self._flywheel.reward(reward, idempotency_key=episode_id)
        except Exception as e:  # counted, never hidden
            return Answer(q.id, "", False, False, 0.0, 0.0, "?", repr(e), episode_id)
        return Answer(
            q.id, text, verdict.valid, verdict.parsable, verdict.partial, reward, version,
            episode_id=episode_id,
        )  # fmt: skip

    def keep_the_best(self, answers: Sequence[Answer]) -> int:
        """Rejection sampling: each valid answer's call copied as a demonstration, its token
        ids as sampled (POST /v1/demonstrations `from_episode`); how many were new."""
        return sum(
            r.status == "created"
            for a in answers
            if a.valid and a.episode_id
            for r in self._flywheel.demonstrate_episode(a.episode_id, agent=AGENT)
        )

    def evaluate(
        self,
        version: int,
        questions: Sequence[Question] | None = None,
        progress: Callable[[list[Answer], int], None] | None = None,
    ) -> Evaluation:
        """The held-out part (or `questions`) at temperature 0 through policy@N; `progress` is
        told the answers so far and how many were asked, after each answer."""
        asked = list(self.held_out if questions is None else questions)

        def one(q: Question) -> Answer:
            try:
                with self._flywheel.episode(f"eval-{q.id}", EVAL_AGENT):
                    text, served = self._ask(q, f"policy@{version}", 0.0)
            except Exception as e:
                return Answer(q.id, "", False, False, 0.0, 0.0, "?", failed=repr(e))
            verdict = q.score(text)
            return Answer(q.id, text, verdict.valid, verdict.parsable, verdict.partial, 0.0, served)

        futures = [self._pool.submit(one, q) for q in asked]
        done: list[Answer] = []
        for future in as_completed(futures):
            done.append(future.result())
            if progress is not None:
                progress(done, len(asked))
        answers = [f.result() for f in futures]
        failed = [a.failed for a in answers if a.failed]
        if failed:
            raise RuntimeError(f"{len(failed)} held-out calls failed, e.g. {failed[0]}")
        n = len(answers)
        return Evaluation(
            version,
            sum(a.valid for a in answers) / n,
            sum(a.parsable for a in answers) / n,
            n,
            answers,
        )

    def _ask(self, q: Question, model: str, temperature: float) -> tuple[str, str]:
        raw = self._openai.chat.completions.with_raw_response.create(
            model=model,
            messages=prompt(q),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=temperature,
        )
        text = raw.parse().choices[0].message.content or ""
        return text, raw.headers.get("x-policy-version", "?")


def run(
    base_url: str,
    rounds: int | None,
    report: Callable[[int, list[Answer], Evaluation | None], None],
    *,
    eval_every: int = 5,
    reward: Reward = "binary",
    demonstrate: bool = True,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> list[Answer]:
    """The warm start's demonstrations, then rounds until `rounds` (None: until stopped), the
    held-out part asked every `eval_every` versions (and of the base model first)."""
    agent = BfclAgent(base_url, reward=reward)
    history: list[Answer] = []
    try:
        if demonstrate:
            posted = agent.post_demonstrations()
            say(
                f"posted {posted} demonstrations ({len(agent.train)} training-part answers): "
                "the trainer's warm start"
            )
        say(f"asking the base model the {len(agent.held_out)} held-out questions (minutes)")
        last = agent.evaluate(0, progress=every_tenth(say))
        say(f"held-out, base model: {last.accuracy:.2f} valid, {last.parsable:.2f} parsable")
        r = 0
        while rounds is None or r < rounds:
            answers = agent.round()
            history += answers
            served = [int(a.policy_version) for a in answers if a.policy_version.isdigit()]
            newest = max(served, default=0)
            if newest - last.version >= eval_every:
                last = agent.evaluate(newest)
            report(r, answers, last)
            r += 1
    finally:
        agent.close()
    return history


def every_tenth(say: Callable[[str], None]) -> Callable[[list[Answer], int], None]:
    """A progress line for every tenth of an evaluation answered (the first screen is never
    silent for minutes while the base model is asked, the trainer's warm start beside it)."""
    started = time.monotonic()

    def progress(done: list[Answer], asked: int) -> None:
        n = len(done)
        if n == asked or n % max(1, asked // 10) == 0:
            valid = sum(a.valid for a in done)
            parsable = sum(a.parsable for a in done)
            say(
                f"  held-out {n}/{asked} answered: {valid} valid, {parsable} parsable "
                f"({time.monotonic() - started:.0f} s)"
            )

    return progress


def print_round(r: int, answers: list[Answer], held_out: Evaluation | None) -> None:
    versions = sorted({a.policy_version for a in answers})
    failed = sum(a.failed is not None for a in answers)
    partial = sum(a.partial for a in answers) / len(answers)
    details = [f"partial {partial:.2f}", f"policy v{','.join(versions)}"]
    if held_out is not None:
        details.append(
            f"held-out {held_out.accuracy:.2f} valid, {held_out.parsable:.2f} parsable "
            f"(v{held_out.version}, {held_out.questions} questions)"
        )
    print_line(r, [float(a.valid) for a in answers], failed, *details, width=20)


def _args(values: Any) -> dict[str, Any]:
    return {"eval_every": values.eval_every, "reward": values.reward}


if __name__ == "__main__":
    parser = command_line(__doc__.split("\n\n")[0])
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--reward", choices=["binary", "partial"], default="binary")
    args = parser.parse_args()
    run(args.base_url, args.rounds, print_round, **_args(args))
