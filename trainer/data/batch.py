"""From claimed transitions to engine samples, setting aside (and counting) what can't be trained.

Token ids are the ones vLLM sampled, as recorded: never re-tokenised. Torch-free: the engine
(trainer/learner/engine.py) takes the `Sample`s built here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainer.config import TrainerSettings
from trainer.data.advantages import RunningBaseline, Scored, flat_groups, group_advantages
from trainer.data.sampling import Sampling, SetAside, sampling_of
from trainer.data.store import Claimed


@dataclass(frozen=True)
class Sample:
    """One transition as the engine sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per completion token
    advantage: float
    reward: float
    sampling: Sampling  # what vLLM sampled it with (the learner's log-probs use the same)
    staleness: int  # versions of the lineage published since it was sampled
    ballast: bool = False  # a copy that evens out ranks' shards; nothing is learned from it


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
    sampling: dict[str, Sampling] = field(default_factory=dict)  # transition id -> its settings

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


def unscorable(
    prompt_ids: Sequence[int] | None,
    completion_ids: Sequence[int] | None,
    logprobs: Sequence[float] | None,
    limits: ModelLimits,
) -> str | None:
    """Why a recorded call's completion cannot be scored by this model (None: it can): what a
    training step and an off-policy estimate (trainer/candidate.py) both need of it."""
    if not prompt_ids or not completion_ids:
        return "missing_token_ids"
    if logprobs is None or len(logprobs) != len(completion_ids):
        return "missing_logprobs"
    ids = (*prompt_ids, *completion_ids)
    if min(ids) < 0 or max(ids) >= limits.vocab_size:
        return "token_out_of_vocab"  # sampled by a different base model
    if len(ids) > limits.max_length:
        return "too_long"
    return None


def skip_reason(
    c: Claimed,
    settings: TrainerSettings,
    staleness: Callable[[int], int],
    limits: ModelLimits,
    sampled: Sampling | SetAside,
) -> str | None:
    why = unscorable(c.prompt_token_ids, c.completion_token_ids, c.logprobs, limits)
    if why is not None:
        return why
    if c.policy_version is None:
        return "not_the_policy"  # served by a model that is not ours to train
    if isinstance(sampled, SetAside):
        return sampled.reason  # greedy, constrained decoding, settings not reproduced
    if c.age_s > settings.max_age_s:
        return "too_old"
    if settings.max_staleness is not None and staleness(c.policy_version) > settings.max_staleness:
        return "stale"
    return None


def build_batch(
    claimed: list[Claimed],
    settings: TrainerSettings,
    *,
    staleness: Callable[[int], int],
    baseline: RunningBaseline | None,
    limits: ModelLimits,
    sampling_defaults: dict[str, float],
) -> Batch:
    batch = Batch()
    usable = []
    for c in claimed:
        sampled = sampling_of(
            c.params, sampling_defaults, made_tool_call=c.made_tool_call, route=c.route
        )
        reason = skip_reason(c, settings, staleness, limits, sampled)
        if reason is None:
            assert isinstance(sampled, Sampling)
            usable.append(c)
            batch.sampling[c.id] = sampled
        else:
            batch.skipped[c.id] = reason
    scored = [Scored(c.id, c.episode_id, c.task_id, c.agent_name, c.ret) for c in usable]
    if settings.flat_groups == "skip":
        flat = flat_groups(scored)
        for transition_id in flat:
            batch.skipped[transition_id] = "no_signal"
        scored = [s for s in scored if s.transition_id not in flat]
    advantages, set_aside = group_advantages(scored, baseline)
    for transition_id in set_aside:
        batch.skipped[transition_id] = "ungrouped"
    for c in usable:
        if c.id in advantages:
            assert c.prompt_token_ids and c.completion_token_ids and c.logprobs
            assert c.policy_version is not None
            batch.samples.append(
                Sample(
                    prompt_ids=c.prompt_token_ids,
                    completion_ids=c.completion_token_ids,
                    logprobs=c.logprobs,
                    advantage=advantages[c.id],
                    reward=c.ret,
                    sampling=batch.sampling[c.id],
                    staleness=staleness(c.policy_version),
                )
            )
            batch.trained[c.id] = c.ret
    return batch
