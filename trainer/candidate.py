"""A candidate version judged on logged traffic before it is published (FLYWHEEL_OPE): its
estimated episode reward against the current version's (trainer/ope.py, docs/promotion.md).

The window is the newest rewarded episodes no version learned from (`trainer/data/logged.py`): the
held-out share of episodes (FLYWHEEL_OPE_HOLDOUT), and the current version's episodes no step has
claimed. Each call of the lineage is scored under the candidate's weights, and under the current
version's when another version served it (for its own, the recorded log-probabilities are the
current version's; for a call the current version was scored on when it was the candidate, that
score: `Evaluated.scores`, kept by the trainer and passed back as `known`). Calls of other
lineages or models keep weight 1. An episode is left out when one of the lineage's calls cannot
be weighed: no token ids or logprobs, greedy or constrained decoding (trainer/data/sampling.py), or
longer than the model takes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from trainer.config import TrainerSettings
from trainer.data.batch import ModelLimits, unscorable
from trainer.data.logged import LoggedCall
from trainer.data.sampling import Sampling, SetAside, sampling_of
from trainer.learner.scoring import Completion, Scorer
from trainer.ope import Comparison, Estimate, LoggedEpisode, Window, compare

log = logging.getLogger("flywheel.trainer")


@dataclass
class Evaluated:
    comparison: Comparison | None  # None: no episode to estimate on
    episodes: int = 0
    calls: int = 0  # the lineage's calls weighed (a forward pass each under the new weights)
    rescored: int = 0  # of them, served by another version: a pass under the current's too
    left_out: Counter[str] = field(default_factory=Counter)  # episodes, by reason
    seconds: float = 0.0
    reused: int = 0  # of the rescored, the current version's scores kept from its own estimate
    # The candidate's log-probability of each weighed call, by transition id: the current
    # version's scores at the next estimate, should it be published.
    scores: dict[str, float] = field(default_factory=dict)

    def stats(self) -> dict[str, Any]:
        """What the version's `stats` keep (`ope`)."""
        out: dict[str, Any] = {
            "episodes": self.episodes,
            "calls": self.calls,
            "rescored": self.rescored,
            "reused": self.reused,
            "left_out": dict(self.left_out),
            "seconds": round(self.seconds, 3),
        }
        if self.comparison is not None:
            c = self.comparison
            out |= {
                "candidate": _json(c.candidate),
                "current": _json(c.current),
                "difference": _json(c.difference),
                "logged": c.logged,
                "refused": c.difference.refused,
            }
        return out

    @classmethod
    def from_stats(cls, stats: dict[str, Any]) -> Evaluated:
        """What `stats()` kept, read back (a report judging stored versions again): the
        comparison and the counts; the per-call scores are not kept."""
        episodes = int(stats.get("episodes", 0))
        comparison = None
        if stats.get("candidate"):
            refused = stats.get("refused")
            candidate, current, difference = (
                _estimate(stats[key], episodes, refused)
                for key in ("candidate", "current", "difference")
            )
            logged = float(stats.get("logged", 0.0))
            comparison = Comparison(candidate, current, difference, logged)
        return cls(
            comparison,
            episodes=episodes,
            calls=int(stats.get("calls", 0)),
            rescored=int(stats.get("rescored", 0)),
            left_out=Counter(stats.get("left_out") or {}),
            seconds=float(stats.get("seconds", 0.0)),
            reused=int(stats.get("reused", 0)),
        )

    def line(self) -> str:
        """The step log's line."""
        c, took = (
            self.comparison,
            f"{self.episodes} episodes, {self.calls} calls, {self.seconds:.1f} s",
        )
        if c is None:
            return f"ope: no logged episode to estimate on ({_reasons(self.left_out)})"
        if c.difference.refused is not None:
            return f"ope: refused, {c.difference.refused} ({took})"
        d = c.difference
        return (
            f"ope: candidate {_interval(c.candidate)} vs current {_interval(c.current)}, "
            f"difference {d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}], "
            f"ess {c.candidate.ess:.0f}, mean weight {c.candidate.mean_weight:.2f} ({took})"
        )


def evaluate(
    candidate: Scorer,
    current: Scorer,
    calls: list[LoggedCall],
    settings: TrainerSettings,
    *,
    current_version: int,
    sampling_defaults: dict[str, float],
    limits: ModelLimits,
    known: dict[str, float] | None = None,
) -> Evaluated:
    """The candidate's estimate against the current version's on `calls` (`logged.window`).
    `candidate` scores under the new weights, `current` under the current version's: only the
    calls another version served are asked of it (the current version's own have ratio 1), and
    of those only the ones `known` (the current version's scores by transition id) lacks."""
    known = known or {}
    started = time.perf_counter()
    by_episode: dict[str, list[LoggedCall]] = {}
    for call in calls:
        by_episode.setdefault(call.episode_id, []).append(call)
    result = Evaluated(None)
    episodes: list[LoggedEpisode] = []
    rows: list[Completion] = []
    behaviour: list[float] = []
    ids: list[str] = []
    served_by_current: list[bool] = []
    weighed_at: list[list[tuple[int, int]]] = []  # per episode: (its call, that call's row)
    for episode in by_episode.values():
        weighed: list[tuple[int, Completion, LoggedCall]] = []
        reason = None
        for i, call in enumerate(episode):
            if not call.ours:
                continue
            row = completion_of(call, sampling_defaults, limits)
            if isinstance(row, str):
                reason = row
                break
            weighed.append((i, row, call))
        if reason is not None:
            result.left_out[reason] += 1
            continue
        first = episode[0]
        episodes.append(
            LoggedEpisode(
                first.task_id or first.episode_id,
                tuple(c.step_reward for c in episode),
                first.final_reward,
            )
        )
        weighed_at.append([(i, len(rows) + k) for k, (i, _, _) in enumerate(weighed)])
        for _, row, call in weighed:
            assert call.logprobs is not None
            rows.append(row)
            ids.append(call.id)
            behaviour.append(sum(call.logprobs))
            served_by_current.append(call.policy_version == current_version)
    result.episodes, result.calls = len(episodes), len(rows)
    if episodes:
        new = candidate.score(rows) if rows else []
        others = [i for i, own in enumerate(served_by_current) if not own]
        old = {i: known[ids[i]] for i in others if ids[i] and ids[i] in known}
        asked = [i for i in others if i not in old]
        rescored = current.score([rows[i] for i in asked]) if asked else []
        old |= dict(zip(asked, rescored, strict=True))
        result.reused = len(others) - len(asked)
        result.scores = {id_: score for id_, score in zip(ids, new, strict=True) if id_}
        cand_ratios, cur_ratios = [], []
        for logged, at in zip(episodes, weighed_at, strict=True):
            cand, cur = [0.0] * len(logged.rewards), [0.0] * len(logged.rewards)
            for position, index in at:
                cand[position] = new[index] - behaviour[index]
                cur[position] = old[index] - behaviour[index] if index in old else 0.0
            cand_ratios.append(cand)
            cur_ratios.append(cur)
        result.comparison = compare(
            Window(episodes),
            cand_ratios,
            cur_ratios,
            method=settings.ope_method,
            clip=settings.ope_clip,
            min_ess=settings.ope_min_ess,
            resamples=settings.ope_resamples,
            level=settings.ope_level,
            resample=settings.ope_resample,
            seed=settings.seed,
        )
        result.rescored = len(others)
    result.seconds = time.perf_counter() - started
    return result


def completion_of(
    call: LoggedCall, defaults: dict[str, float], limits: ModelLimits
) -> Completion | str:
    """The call as a row to score, or why it cannot be weighed."""
    why = unscorable(call.prompt_token_ids, call.completion_token_ids, call.logprobs, limits)
    if why is not None:
        return why
    assert call.prompt_token_ids and call.completion_token_ids
    sampled = sampling_of(
        call.params, defaults, made_tool_call=call.made_tool_call, route=call.route
    )
    if isinstance(sampled, SetAside):
        return sampled.reason
    assert isinstance(sampled, Sampling)
    return Completion(call.prompt_token_ids, call.completion_token_ids, sampled)


def _json(e: Estimate) -> dict[str, Any]:
    return {
        "value": e.value,
        "low": e.low,
        "high": e.high,
        "ess": round(e.ess, 1),
        "mean_weight": round(e.mean_weight, 4),
    }


def _estimate(d: dict[str, Any], episodes: int, refused: str | None) -> Estimate:
    """`_json`'s inverse."""
    return Estimate(
        d.get("value"),
        d.get("low"),
        d.get("high"),
        float(d.get("ess", 0.0)),
        episodes,
        refused,
        float(d.get("mean_weight", 1.0)),
    )


def _interval(e: Estimate) -> str:
    return f"{e.value:.3f} [{e.low:.3f}, {e.high:.3f}]"


def _reasons(left_out: Counter[str]) -> str:
    if not left_out:
        return "none held out or left unclaimed and rewarded yet"
    return "left out: " + ", ".join(f"{n} {reason}" for reason, n in left_out.most_common())
