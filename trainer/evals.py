"""A new version asked its lineage's eval sets (core/evals.py) before it serves: each item at
temperature 0, straight from vLLM under the adapter's own name (it is loaded, not yet any
alias's: the proxy could not route `policy@N` to a version Postgres does not have yet, and these
calls are not traffic to record), scored, and compared with the current version's score on the
same items. The current version's score is the one stored with it when it was asked the same
set (same digest, and for the `judge` scorer the same judge model); otherwise it is asked now too.

The `judge` scorer grades each answer by asking the judge model (FLYWHEEL_EVAL_JUDGE_*, at
temperature 0, core/ruler.py's `grading` prompt). A judge that cannot be reached, or refuses a
call, leaves the set unscored this time (logged, left out of the gate), never scored 0: a
candidate is not failed for its judge's outage. An answer of the judge's that is not the JSON
asked for scores its item 0, counted among the scorer errors, as a python scorer's bug does.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from core import evals, ruler
from core.vllm import VLLMError
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
    judge: str | None = None  # the `judge` scorer's model (a stored score is reused only by it)

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
        } | ({"judge": self.judge} if self.judge else {})

    @classmethod
    def from_stats(cls, name: str, stats: dict[str, Any]) -> Compared:
        """What `stats()` kept under evals.<name>, read back."""
        items = int(stats["items"])
        errors = int(stats.get("scorer_errors", 0))
        candidate = Score(float(stats["score"]), items, errors, float(stats.get("seconds", 0.0)))
        current = Score(float(stats["current"]), items, 0, 0.0)
        version = int(stats.get("current_version", 0))
        digest, judge = str(stats.get("digest", "")), stats.get("judge")
        return cls(name, digest, candidate, current, version, judge)


def ask(
    replicas: Replicas, model: str, eval_set: evals.EvalSet, settings: TrainerSettings
) -> Score:
    """`model` (a vLLM model name) asked every item of the set, scored. BadEvalSet when the
    set cannot be scored here (its scorer does not import, its judge is unset or unreachable)."""
    started = time.perf_counter()
    judged = eval_set.scorer == evals.JUDGE
    if judged:
        judge_model(settings, eval_set.name)  # BadEvalSet before anything is asked
    else:
        score = evals.scorer(eval_set.scorer)
    bodies = [_body(model, item, settings.eval_max_tokens) for item in eval_set.items]
    replies = replicas.ask(
        bodies, concurrency=settings.eval_concurrency, timeout_s=settings.eval_timeout_s
    )
    answers = [dict(r["choices"][0]["message"]) for r in replies]
    if judged:
        scores = grade(answers, eval_set, settings)
    else:
        scores = [_scored(score, a, item) for a, item in zip(answers, eval_set.items, strict=True)]
    errors = sum(isinstance(s, Exception) for s in scores)
    if errors:  # a scorer's bug scores the item 0, counted, on both sides
        first = next(s for s in scores if isinstance(s, Exception))
        log.warning("eval set %s: %d items not scored (0), e.g. %r", eval_set.name, errors, first)
    total = sum(s for s in scores if not isinstance(s, Exception))
    n = len(eval_set.items)
    return Score(total / n, n, errors, time.perf_counter() - started)


def _scored(score: evals.Scorer, answer: dict[str, Any], item: dict[str, Any]) -> float | Exception:
    try:
        got = float(score(answer, item))
    except Exception as e:
        return e
    return got if math.isfinite(got) else ValueError(f"not a finite number: {got}")


def judge_model(settings: TrainerSettings, name: str) -> str:
    """The `judge` scorer's model; BadEvalSet when none is set."""
    if not settings.eval_judge_model:
        raise evals.BadEvalSet(
            f"eval set {name} is scored by `judge`: set FLYWHEEL_EVAL_JUDGE_MODEL (and "
            "FLYWHEEL_EVAL_JUDGE_URL, unless the trainer's own vLLM is the judge)"
        )
    return settings.eval_judge_model


def grade(
    answers: list[dict[str, Any]], eval_set: evals.EvalSet, settings: TrainerSettings
) -> list[float | Exception]:
    """Each answer graded by the judge model, in order: a score in [0, 1], or the judge's
    answer's fault (ruler.BadAnswer). BadEvalSet when the judge cannot be asked at all."""
    model = judge_model(settings, eval_set.name)
    # The trainer's own vLLM as the judge (no URL set) takes the key the trainer has for it.
    key = settings.eval_judge_api_key
    if key is None and not settings.eval_judge_url:
        key = settings.vllm_api_key
    judge = Replicas(
        [(settings.eval_judge_url or settings.vllm[0]).rstrip("/")],
        key.get_secret_value() if key else None,
    )
    bodies = [
        _judge_body(model, answer, item, settings)
        for answer, item in zip(answers, eval_set.items, strict=True)
    ]
    try:
        replies = judge.ask(
            bodies, concurrency=settings.eval_concurrency, timeout_s=settings.eval_timeout_s
        )
    except (VLLMError, OSError, ValueError) as e:  # ValueError: a 200 that is not JSON
        raise evals.BadEvalSet(f"its judge {model} could not be asked: {e}") from e
    finally:
        judge.close()
    out: list[float | Exception] = []
    for reply in replies:
        try:
            out.append(ruler.parse(reply["choices"][0]["message"].get("content"), 1)[0].score)
        except (ruler.BadAnswer, KeyError, IndexError, TypeError) as e:
            out.append(e)
    return out


def _judge_body(
    model: str, answer: dict[str, Any], item: dict[str, Any], settings: TrainerSettings
) -> dict[str, Any]:
    messages = ruler.grading(
        item["messages"],
        answer,
        rubric=item.get("rubric"),
        reference=item.get("reference"),
        max_chars=settings.eval_judge_max_chars,
    )
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": 512,
    }
    kind = settings.eval_judge_response_format
    if (shape := ruler.response_format(kind, 1)) is not None:
        body["response_format"] = shape
    elif kind == "regex":
        body["structured_outputs"] = {"regex": ruler.answer_regex(1)}
    return body


def compare(
    replicas: Replicas,
    eval_sets: list[evals.EvalSet],
    *,
    candidate: str,
    current: str,
    current_version: int,
    current_stats: dict[str, Any] | None,
    settings: TrainerSettings,
    candidate_stats: dict[str, Any] | None = None,
) -> list[Compared]:
    """Each set asked of `candidate`, beside `current`'s score on it: each side's stored one
    (in its version's stats, for the same set and judge) or asked now."""
    out = []
    for eval_set in eval_sets:
        judge = settings.eval_judge_model if eval_set.scorer == evals.JUDGE else None
        try:
            mine = _stored(candidate_stats, eval_set, judge) or ask(
                replicas, candidate, eval_set, settings
            )
            theirs = _stored(current_stats, eval_set, judge) or ask(
                replicas, current, eval_set, settings
            )
        except evals.BadEvalSet as e:  # its scorer does not import here, the judge went away
            log.error("eval set %s is not asked: %s", eval_set.name, e)
            continue
        out.append(Compared(eval_set.name, eval_set.digest, mine, theirs, current_version, judge))
    return out


def _stored(
    stats: dict[str, Any] | None, eval_set: evals.EvalSet, judge: str | None
) -> Score | None:
    """A version's own score on `eval_set`, kept in its stats (`Compared.stats`) when it was
    asked the same set (digest) with the same judge."""
    kept = ((stats or {}).get("evals") or {}).get(eval_set.name)
    if not isinstance(kept, dict) or kept.get("digest") != eval_set.digest:
        return None
    if kept.get("judge") != judge:
        return None
    return Score(float(kept["score"]), int(kept["items"]), int(kept.get("scorer_errors", 0)), 0.0)


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
