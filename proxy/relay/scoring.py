"""Behaviour logprobs for the outputs vLLM returns without them, filled in off the client's path.

vLLM 0.32's Responses API hangs logprobs on output text only: an output that is nothing but a
function call comes back with its exact token ids and no logprobs (tests/data/vllm_wire/
responses_tools_*), and the trainer cannot use a transition without them. For such a record the
proxy asks the replica that served the call, with the same model or adapter, for the logprob of
each sampled token: `/v1/completions` with the prompt and completion ids as the prompt,
`prompt_logprobs: 0`, `max_tokens: 1`. The record is handed to the writer when that answer is in
(or failed: then it is recorded without logprobs, as before).

vLLM computes prompt logprobs from the raw distribution, which is the one sampled from only at
temperature 1 without top-p/top-k/min-p truncation. Calls sampled otherwise are not scored. On
this machine the scored values equal the sampled ones exactly (tests/e2e/test_e2e_clients.py checks
it on a text answer, where vLLM returns both). The vLLM must not set other sampling defaults of
its own (`--generation-config vllm`, as `flywheel up` and the images start it, or a model
without `generation_config.json` defaults).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from core.record import TransitionRecord
from proxy import metrics
from proxy.record.intake import Intake
from proxy.relay.http1 import UpstreamBroken
from proxy.relay.upstream import Upstream

log = logging.getLogger(__name__)

NEUTRAL = {
    "temperature": (None, 1, 1.0),
    "top_p": (None, 1, 1.0),
    "top_k": (None, -1, 0),
    "min_p": (None, 0, 0.0),
}


def needs_scoring(record: TransitionRecord) -> bool:
    """A finished call whose ids are known but whose logprobs vLLM left out, sampled from the
    raw distribution."""
    ids = record.completion_token_ids
    return bool(
        record.status == "ok"
        and record.prompt_token_ids
        and ids
        and len(record.logprobs or ()) != len(ids)
        and all(record.params.get(k) in allowed for k, allowed in NEUTRAL.items())
    )


class Scorer:
    def __init__(self, *, upstream: Upstream, intake: Intake) -> None:
        self._upstream = upstream
        self._intake = intake  # the record wing's door
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, replica_url: str, record: TransitionRecord) -> None:
        """Score `record` on the replica that sampled it, then hand it to the writer (which
        counts it as unstored from now on: a reward naming it waits for it)."""
        self._intake.expect([record])
        task = asyncio.create_task(self._score_then_record(replica_url, record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, timeout: float) -> None:
        """Let the scoring in flight finish for up to `timeout` (each record is handed over
        however it ends: unscored when cancelled)."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _score_then_record(self, replica_url: str, record: TransitionRecord) -> None:
        outcome = "failed"
        try:
            scored = await self._score(replica_url, record)
            if scored is not None:
                record.logprobs, outcome = scored, "ok"
        except (UpstreamBroken, TimeoutError, ValueError, KeyError, TypeError) as e:
            log.warning("scoring transition %s failed: %r", record.id, e)
        finally:  # also when cancelled at shutdown: the record itself is never dropped
            metrics.logprobs_scored.labels(outcome).inc()
            self._intake.submit([record])

    async def _score(self, replica_url: str, record: TransitionRecord) -> list[float] | None:
        prompt, completion = record.prompt_token_ids or [], record.completion_token_ids or []
        body = {
            "model": record.model_used,
            "prompt": [*prompt, *completion],
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 1.0,
        }
        replica = self._upstream.replica(replica_url)
        response = await self._upstream.post(replica, "/v1/completions", orjson.dumps(body))
        try:
            payload = await response.read()
        finally:
            response.release()
        if response.status != 200:
            log.warning(
                "scoring transition %s: vLLM answered %s %s",
                record.id,
                response.status,
                payload[:300],
            )
            return None
        return sampled_logprobs(orjson.loads(payload), len(prompt), completion)


def sampled_logprobs(data: dict[str, Any], offset: int, completion: list[int]) -> list[float]:
    """The logprob of each completion token, from vLLM's `prompt_logprobs` (one dict per prompt
    position, keyed by token id, the actual token always among them)."""
    positions = data["choices"][0]["prompt_logprobs"][offset:]
    return [float(p[str(t)]["logprob"]) for p, t in zip(positions, completion, strict=True)]
