"""From claimed transitions to engine samples, setting aside (and counting) what can't be trained.

Token ids are the ones vLLM sampled, as recorded: never re-tokenised. Torch-free: the engine
(trainer/engine.py) takes the `Sample`s built here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainer.advantages import RunningBaseline, Scored, group_advantages
from trainer.config import TrainerSettings
from trainer.store import Claimed


@dataclass(frozen=True)
class Sample:
    """One transition as the engine sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per completion token
    advantage: float
    reward: float


@dataclass(frozen=True)
class ModelLimits:
    """What the model being trained can take (recorded data may come from another base model)."""

    vocab_size: int
    max_length: int


@dataclass
class Batch:
    samples: list[Sample] = field(default_factory=list)
    trained: dict[str, float] = field(default_factory=dict)  # transition id -> its return
    skipped: dict[str, str] = field(default_factory=dict)  # transition id -> reason

    @property
    def skip_counts(self) -> Counter[str]:
        return Counter(self.skipped.values())

    @property
    def reward_mean(self) -> float:
        return sum(s.reward for s in self.samples) / len(self.samples)


def staleness_in(lineage_versions: Sequence[int], current: int) -> Callable[[int], int]:
    """How many of the lineage's versions (ascending) were published after the one a transition
    was sampled from, up to `current` (0: the base model). Version numbers are shared by every
    lineage, so their difference would count the other lineages' publishes too."""
    upto = bisect_right(lineage_versions, current)
    return lambda sampled: max(0, upto - bisect_right(lineage_versions, sampled))


def skip_reason(
    c: Claimed, settings: TrainerSettings, staleness: Callable[[int], int], limits: ModelLimits
) -> str | None:
    if not c.prompt_token_ids or not c.completion_token_ids:
        return "missing_token_ids"
    if c.logprobs is None or len(c.logprobs) != len(c.completion_token_ids):
        return "missing_logprobs"
    ids = (*c.prompt_token_ids, *c.completion_token_ids)
    if min(ids) < 0 or max(ids) >= limits.vocab_size:
        return "token_out_of_vocab"  # sampled by a different base model
    if len(c.prompt_token_ids) + len(c.completion_token_ids) > limits.max_length:
        return "too_long"
    if c.policy_version is None:
        return "not_the_policy"  # served by a model that is not ours to train
    if staleness(c.policy_version) > settings.max_staleness:
        return "stale"
    # The behaviour logprobs are of the distribution vLLM sampled; TRL recomputes them at one
    # temperature and without top-p/top-k, so other sampling settings would bias the IS ratio.
    temperature = c.params.get("temperature")
    if temperature is not None and abs(float(temperature) - settings.temperature) > 1e-6:
        return "other_temperature"
    if c.params.get("top_p") not in (None, 1, 1.0) or c.params.get("top_k") not in (None, -1, 0):
        return "truncated_sampling"
    return None


def build_batch(
    claimed: list[Claimed],
    settings: TrainerSettings,
    *,
    staleness: Callable[[int], int],
    baseline: RunningBaseline | None,
    limits: ModelLimits,
) -> Batch:
    batch = Batch()
    usable = []
    for c in claimed:
        reason = skip_reason(c, settings, staleness, limits)
        if reason is None:
            usable.append(c)
        else:
            batch.skipped[c.id] = reason
    scored = [Scored(c.id, c.episode_id, c.task_id, c.agent_name, c.ret) for c in usable]
    advantages, set_aside = group_advantages(scored, baseline)
    for transition_id in set_aside:
        batch.skipped[transition_id] = "ungrouped"
    for c in usable:
        if c.id in advantages:
            assert c.prompt_token_ids and c.completion_token_ids and c.logprobs
            batch.samples.append(
                Sample(
                    c.prompt_token_ids, c.completion_token_ids, c.logprobs, advantages[c.id], c.ret
                )
            )
            batch.trained[c.id] = c.ret
    return batch
