"""A new version asked its lineage's eval sets (core/evals.py) before it serves: each item at
temperature 0, straight from vLLM under the adapter's own name (it is loaded, not yet any
alias's: the proxy could not route `policy@N` to a version Postgres does not have yet, and these
calls are not traffic to record), scored, and compared with the current version's score on the
same items. The current version's score is the one stored with it when it was asked the same
set (same digest); otherwise it is asked now too.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from core import evals
from trainer.config import TrainerSettings
from trainer.vllm import Replicas

log = logging.getLogger("flywheel.trainer")


@dataclass(frozen=True)
class Score:
    score: float  # the mean of the items' scores
    items: int
    scorer_errors: int  # items whose scorer raised or gave no finite number: scored 0
    seconds: float


@dataclass(frozen=True)
class Compared:
    """One eval set: the candidate's score against the current version's."""

    name: str
    digest: str
    candidate: Score
    current: Score
    current_version: int  # 0: the base model

    @property
    def difference(self) -> float:
        return self.candidate.score - self.current.score

    def stats(self) -> dict[str, object]:
        """What adapter_version.stats keeps under evals.<name>: a later version reuses `score`
        as the current one's when `digest` still matches."""
        return {
            "score": round(self.candidate.score, 6),
            "items": self.candidate.items,
            "scorer_errors": self.candidate.scorer_errors,
            "seconds": round(self.candidate.seconds, 2),
            "digest": self.digest,
            "current": round(self.current.score, 6),
            "current_version": self.current_version,
        }

    @classmethod
    def from_stats(cls, name: str, stats: dict[str, Any]) -> Compared:
        """What `stats()` kept under evals.<name>, read back."""
        items = int(stats["items"])
        errors = int(stats.get("scorer_errors", 0))
        candidate = Score(float(stats["score"]), items, errors, float(stats.get("seconds", 0.0)))
        current = Score(float(stats["current"]), items, 0, 0.0)
        version = int(stats.get("current_version", 0))
        return cls(name, str(stats.get("digest", "")), candidate, current, version)


def ask(
    replicas: Replicas, model: str, eval_set: evals.EvalSet, settings: TrainerSettings
) -> Score:
    """`model` (a vLLM model name) asked every item of the set, scored."""
    started = time.perf_counter()
    score = evals.scorer(eval_set.scorer)  # BadEvalSet before anything is asked
    bodies = [_body(model, item, settings.eval_max_tokens) for item in eval_set.items]
    answers = replicas.ask(
        bodies, concurrency=settings.eval_concurrency, timeout_s=settings.eval_timeout_s
    )
    total, errors = 0.0, 0
    for answer, item in zip(answers, eval_set.items, strict=True):
        try:
            got = float(score(dict(answer["choices"][0]["message"]), item))
            if not math.isfinite(got):
                raise ValueError(f"not a finite number: {got}")
        except Exception as e:  # a scorer's bug scores the item 0, counted, on both sides
            errors += 1
            if errors == 1:
                log.warning("eval set %s: the scorer failed on an item: %r", eval_set.name, e)
            got = 0.0
        total += got
    n = len(eval_set.items)
    return Score(total / n, n, errors, time.perf_counter() - started)


def compare(
    replicas: Replicas,
    eval_sets: list[evals.EvalSet],
    *,
    candidate: str,
    current: str,
    current_version: int,
    current_stats: dict[str, Any] | None,
    settings: TrainerSettings,
) -> list[Compared]:
    """Each set asked of `candidate`, beside `current`'s stored or fresh score on it."""
    stored = (current_stats or {}).get("evals") or {}
    out = []
    for eval_set in eval_sets:
        try:
            mine = ask(replicas, candidate, eval_set, settings)
        except evals.BadEvalSet as e:  # its scorer does not import here: it cannot be scored
            log.error("eval set %s is not asked: %s", eval_set.name, e)
            continue
        kept = stored.get(eval_set.name)
        if isinstance(kept, dict) and kept.get("digest") == eval_set.digest:
            theirs = Score(float(kept["score"]), int(kept["items"]), 0, 0.0)
        else:
            theirs = ask(replicas, current, eval_set, settings)
        out.append(Compared(eval_set.name, eval_set.digest, mine, theirs, current_version))
    return out


def line(compared: list[Compared]) -> str:
    return "; ".join(
        f"eval {c.name}: {c.candidate.score:.3f} against {c.current.score:.3f} "
        f"(v{c.current_version}) on {c.candidate.items} items, {c.candidate.seconds:.1f}s"
        for c in compared
    )


def _body(model: str, item: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": item["messages"],
        "temperature": 0.0,
        "max_tokens": item.get("max_tokens") or max_tokens,
    }
    if item.get("tools"):
        body["tools"] = item["tools"]
    return body
