"""`flywheel judge`: claims due episodes, ranks each task's group with the judge model through
litellm, posts the scores to the proxy as final rewards (source `judge`, so credit assignment
and the trainer take them as any reward), and records each judgement with its rationale.

Never in the way of serving: it is its own process, its database transactions are short and
never span a judge call, and its only path into the proxy is `POST /v1/rewards`. Judge calls
run `judge_concurrency` at a time, at most `judge_rpm` a minute, each retried by litellm
(`judge_retries`, with backoff); a group whose answer is not the JSON asked for, or whose call
failed after its retries, is marked failed and tried again in a later round
(`judge_attempts`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import json
import logging
import math
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from core import database, ruler
from core.tenants import Principal
from judge import store
from judge.config import JudgeSettings

log = logging.getLogger("flywheel.judge")


LEASE_S = 600.0  # a claim outlives the slowest judge call; an expired one is taken over
CLAIM_BATCH = 256  # due episodes looked at per round


@dataclass
class Round:
    """What one round did, for the log and the tests."""

    groups: int = 0
    judged: int = 0
    failed: int = 0
    skipped: int = 0  # a final reward came while the judge was at it
    cost_usd: float = 0.0
    errors: list[str] = field(default_factory=list)


class Judge:
    def __init__(self, settings: JudgeSettings) -> None:
        self.settings = settings
        self.principal = Principal(
            None if settings.judge_tenant in (None, "default") else settings.judge_tenant,
            frozenset(),
        )
        self.rubrics = (
            json.loads(settings.judge_rubrics.read_text()) if settings.judge_rubrics else {}
        )
        url = database.resolve_url(settings.database_url, settings.home)
        self._engine, self._sessions = database.create_sessions(url)
        self._name = f"judge-{socket.gethostname()}-{os.getpid()}"
        self._calls = asyncio.Semaphore(settings.judge_concurrency)
        self._next_start = 0.0  # judge_rpm: when the next call may start

    def close(self) -> None:
        self._engine.dispose()

    async def run(self) -> None:
        while True:
            done = await self.round()
            if done.groups:
                log.info(
                    "judged %d episodes in %d groups (%d failed, %d skipped), $%.4f",
                    *(done.judged, done.groups, done.failed, done.skipped, done.cost_usd),
                )
            else:
                await asyncio.sleep(self.settings.judge_poll_s)

    async def round(self) -> Round:
        """Claim what is due, judge it group by group, concurrently; one pass."""
        groups = await asyncio.to_thread(self._claim)
        done = Round(groups=len(groups))
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(self._judge(group, http, done) for group in groups))
        return done

    # --- claiming -----------------------------------------------------------------------------

    def _claim(self) -> list[list[store.Due]]:
        s = self.settings
        with self._sessions.begin() as session:
            due = store.due(
                self.principal,
                grace_s=s.judge_grace_s,
                attempts=s.judge_attempts,
                limit=CLAIM_BATCH,
                session=session,
            )
            groups = self._groups(due)
            ids = [d.episode_id for group in groups for d in group]
            if ids:
                store.claim(ids, judge=self._name, lease_s=LEASE_S, session=session)
        return groups

    def _groups(self, due: list[store.Due]) -> list[list[store.Due]]:
        """By task, `judge_group_size` at most; a task with fewer than `judge_min_group` due
        waits for more until its oldest has waited `judge_alone_after_s`. Episodes without a task
        are judged alone (nothing to rank them against)."""
        s = self.settings
        by_task: dict[str | None, list[store.Due]] = defaultdict(list)
        for d in due:
            task = None if d.task_id is None else self.principal.public(d.task_id)
            if s.judge_tasks and not any(fnmatch.fnmatchcase(task or "", p) for p in s.judge_tasks):
                continue
            by_task[d.task_id].append(d)
        groups: list[list[store.Due]] = []
        now = time.time()
        for task, episodes in by_task.items():
            if task is None:
                groups.extend([d] for d in episodes)
                continue
            waited = now - episodes[0].last_call_at.timestamp() - s.judge_grace_s
            if len(episodes) < s.judge_min_group and waited < s.judge_alone_after_s:
                continue
            # As even as can be: 9 due in groups of 8 are 5 and 4, not 8 and a lone one.
            k = math.ceil(len(episodes) / s.judge_group_size)
            groups.extend(episodes[i::k] for i in range(k))
        return groups

    # --- one group ----------------------------------------------------------------------------

    async def _judge(
        self, group: list[store.Due], http: aiohttp.ClientSession, done: Round
    ) -> None:
        ids = [d.episode_id for d in group]
        try:
            calls = await asyncio.to_thread(self._calls_of, ids)
            task = group[0].task_id
            rubric = ruler.rubric_for(
                None if task is None else self.principal.public(task), self.rubrics
            )
            messages = ruler.prompt(rubric, [calls[i] for i in ids], self.settings.judge_max_chars)
            answer, usage, cost = await self._ask(messages, len(ids))
            scores = ruler.parse(answer, len(ids))
            verdicts = await self._post(ids, scores, http)
        except Exception as e:  # the call, its answer, the proxy: all worth another attempt later
            reason = f"{type(e).__name__}: {e}"
            log.warning(
                "judging %d episodes of task %s failed: %s", len(ids), group[0].task_id, reason
            )
            await asyncio.to_thread(self._failed, ids, reason)
            done.failed += len(ids)
            done.errors.append(reason)
            return
        await asyncio.to_thread(self._judged, verdicts, usage, cost)
        done.judged += sum(v.score is not None for v in verdicts)
        done.skipped += sum(v.score is None for v in verdicts)
        done.cost_usd += cost or 0.0

    def _calls_of(self, ids: list[str]) -> dict[str, list[ruler.Call]]:
        with self._sessions() as session:
            return store.calls(ids, session=session)

    async def _ask(
        self, messages: list[dict[str, str]], n: int
    ) -> tuple[str | None, dict[str, Any], float | None]:
        s = self.settings
        async with self._calls:
            await self._pace()
            kwargs: dict[str, Any] = {}
            if s.judge_input_cost_per_token is not None:
                kwargs["input_cost_per_token"] = s.judge_input_cost_per_token
            if s.judge_output_cost_per_token is not None:
                kwargs["output_cost_per_token"] = s.judge_output_cost_per_token
            if (rf := ruler.response_format(s.judge_response_format, n)) is not None:
                kwargs["response_format"] = rf
            elif s.judge_response_format == "regex":  # vLLM's own request field
                kwargs["extra_body"] = {"structured_outputs": {"regex": ruler.answer_regex(n)}}
            response = await _litellm().acompletion(
                model=s.judge_model,
                messages=messages,
                api_base=s.judge_api_base,
                api_key=s.judge_api_key.get_secret_value() if s.judge_api_key else None,
                temperature=0,
                timeout=s.judge_timeout_s,
                num_retries=s.judge_retries,
                **kwargs,
            )
        usage = dict(getattr(response, "usage", None) or {})
        return response.choices[0].message.content, usage, _cost(response)

    async def _pace(self) -> None:
        if self.settings.judge_rpm is None:
            return
        now = time.monotonic()
        start = max(now, self._next_start)
        self._next_start = start + 60.0 / self.settings.judge_rpm
        await asyncio.sleep(start - now)

    async def _post(
        self, ids: list[str], scores: list[ruler.Score], http: aiohttp.ClientSession
    ) -> list[store.Verdict]:
        """Post the scores of the episodes still without a final reward; the others are
        `skipped` (the application's reward came first, and stays)."""
        open_ = await asyncio.to_thread(self._unrewarded, ids)
        verdicts = [
            store.Verdict(i, s.score if i in open_ else None, s.explanation)
            for i, s in zip(ids, scores, strict=True)
        ]
        rewards = [
            {
                "episode_id": self.principal.public(v.episode_id),
                "reward": v.score,
                "source": "judge",
                "idempotency_key": "judge",  # a retried post stores nothing twice
            }
            for v in verdicts
            if v.score is not None
        ]
        if rewards:
            headers = {}
            if self.settings.judge_key:
                headers["Authorization"] = f"Bearer {self.settings.judge_key.get_secret_value()}"
            url = self.settings.judge_proxy.rstrip("/") + "/v1/rewards"
            async with http.post(url, json=rewards, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"the proxy answered {r.status}: {(await r.text())[:300]}")
        return verdicts

    def _unrewarded(self, ids: list[str]) -> set[str]:
        with self._sessions() as session:
            return store.still_unrewarded(ids, session=session)

    def _judged(
        self, verdicts: list[store.Verdict], usage: dict[str, Any], cost: float | None
    ) -> None:
        with self._sessions.begin() as session:
            store.judged(
                verdicts,
                model=self.settings.judge_model,
                usage=usage,
                cost_usd=cost,
                session=session,
            )

    def _failed(self, ids: list[str], reason: str) -> None:
        with self._sessions.begin() as session:
            store.failed(ids, reason, session=session)


@functools.cache
def _litellm() -> Any:
    """litellm, imported on first use: it is the judge install's alone (the `judge` extra), and
    it would fetch its price list from GitHub at import unless told to use the copy it ships."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def _cost(response: Any) -> float | None:
    """What the call cost in USD, when litellm knows the model's price (or was given one)."""
    cost = (getattr(response, "_hidden_params", None) or {}).get("response_cost")
    if cost is None:
        try:
            cost = _litellm().completion_cost(completion_response=response)
        except Exception:  # an unmapped model (a local one): no price
            return None
    return float(cost)


def run(settings: JudgeSettings, *, once: bool = False) -> Round | None:
    """The judge process (`flywheel judge`); `once`: one round, then exit (cron, tests)."""
    judge = Judge(settings)
    try:
        if once:
            return asyncio.run(judge.round())
        asyncio.run(judge.run())
        return None
    finally:
        judge.close()
