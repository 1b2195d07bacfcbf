"""Prometheus metrics of the trainer (served on `metrics_port`), each labelled with the lineage
it trains, so several trainers (one per lineage) chart side by side."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

from core.canary import Evidence

_STEPS = Counter("flywheel_trainer_steps_total", "Training steps published.", ["lineage"])
_STEP_FAILURES = Counter(
    "flywheel_trainer_step_failures_total", "Steps that did not publish.", ["lineage", "reason"]
)
_TRAINED = Counter(
    "flywheel_trainer_transitions_trained_total", "Transitions trained on.", ["lineage"]
)
_SKIPPED = Counter(
    "flywheel_trainer_transitions_skipped_total", "Transitions set aside.", ["lineage", "reason"]
)
_REWARD_MEAN = Gauge(
    "flywheel_trainer_batch_reward_mean", "Mean return of the last batch.", ["lineage"]
)
_LOSS = Gauge("flywheel_trainer_loss", "Loss of the last step.", ["lineage"])
_CLIP_FRACTION = Gauge(
    "flywheel_trainer_clip_fraction", "PPO clip fraction of the last step.", ["lineage"]
)
_KL = Gauge(
    "flywheel_trainer_kl",
    "Mean per-token KL to the reference (FLYWHEEL_KL_ANCHOR) of the last step; beta > 0 only.",
    ["lineage"],
)
_IS_RATIO = Gauge(
    "flywheel_trainer_is_ratio",
    "Importance-sampling ratio of the last step.",
    ["lineage", "stat"],
)
_STALENESS = Gauge(
    "flywheel_trainer_staleness_versions",
    "Mean versions of the lineage published between sampling and training.",
    ["lineage"],
)
_CORRECTED_TOKENS = Counter(
    "flywheel_trainer_completion_tokens_total",
    "Completion tokens trained on, by staleness (versions of the lineage since they were "
    "sampled) and what the off-policy correction did: kept, truncated (weight capped at "
    "is_cap, still trained) or rejected (out of the loss).",
    ["lineage", "staleness", "outcome"],
)
_TRAINABLE_RATIO = Gauge(
    "flywheel_trainer_trainable_ratio",
    "Of the transitions this trainer claimed in the last hour, the share it trained (the rest "
    "it set aside: flywheel_trainer_transitions_skipped_total by reason; flywheel status has "
    "every recorded call's fate).",
    ["lineage"],
)
_QUEUE = Gauge(
    "flywheel_trainer_queue_transitions", "Credited, untrained transitions waiting.", ["lineage"]
)
_DEMONSTRATIONS_DUE = Gauge(
    "flywheel_trainer_queue_demonstrations",
    "Demonstrations still due an epoch of supervised steps (trainer/learner/sft.py).",
    ["lineage"],
)
_SFT_STEPS = Counter(
    "flywheel_trainer_sft_steps_total",
    "Supervised steps on demonstrations published (also counted in steps_total).",
    ["lineage"],
)
_SFT_LOSS = Gauge(
    "flywheel_trainer_sft_loss",
    "Mean negative log-likelihood per answer token of the last supervised step.",
    ["lineage"],
)
_CURRENT_VERSION = Gauge(
    "flywheel_trainer_current_version", "The version the lineage's alias serves.", ["lineage"]
)
_PINNED = Gauge(
    "flywheel_trainer_pinned",
    "1 while the lineage is pinned by hand (the trainer waits, its queue kept), else 0.",
    ["lineage"],
)
_BACKOFF = Gauge(
    "flywheel_trainer_backoff_seconds",
    "The wait after a step failed on Postgres or vLLM (doubling while they keep failing; "
    "flywheel_trainer_step_failures_total says which); 0 once a step gets through.",
    ["lineage"],
)
_STEP_SECONDS = Histogram(
    "flywheel_trainer_step_seconds",
    "Time to train one batch.",
    ["lineage"],
    buckets=(0.1, 0.5, 1, 5, 30, 120),
)
_SWAP_SECONDS = Histogram(
    "flywheel_trainer_swap_seconds",
    "Time to load a new adapter into every vLLM.",
    ["lineage"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5),
)
_CANARY_CANDIDATE = Gauge(
    "flywheel_trainer_canary_candidate",
    "The version under canary test (0: none open).",
    ["lineage"],
)
_CANARY_EPISODES = Gauge(
    "flywheel_trainer_canary_episodes",
    "Rewarded episodes of the open canary, per arm (candidate, baseline).",
    ["lineage", "arm"],
)
_CANARY_REWARD = Gauge(
    "flywheel_trainer_canary_reward_mean",
    "Mean episode reward of the open canary, per arm (candidate, baseline).",
    ["lineage", "arm"],
)
_CANARY_DECISIONS = Counter(
    "flywheel_trainer_canary_decisions_total",
    "Canaries decided: promote or rollback, and why (worse, not_worse, timeout).",
    ["lineage", "action", "reason"],
)

_GATE_DECISIONS = Counter(
    "flywheel_trainer_gate_decisions_total",
    "New versions decided by the promotion gate (FLYWHEEL_GATE): pass, fail or inconclusive.",
    ["lineage", "outcome"],
)
_EVAL_SCORE = Gauge(
    "flywheel_trainer_eval_score",
    "The newest version's score on each of the lineage's eval sets (candidate), and the "
    "score of the version it was compared with (current).",
    ["lineage", "eval_set", "version"],
)


class LineageMetrics:
    """The series of one lineage."""

    def __init__(self, lineage: str) -> None:
        self.lineage = lineage
        self.steps = _STEPS.labels(lineage)
        self.trained = _TRAINED.labels(lineage)
        self.reward_mean = _REWARD_MEAN.labels(lineage)
        self.loss = _LOSS.labels(lineage)
        self.clip_fraction = _CLIP_FRACTION.labels(lineage)
        self.kl = _KL.labels(lineage)
        self.staleness = _STALENESS.labels(lineage)
        self.queue = _QUEUE.labels(lineage)
        self.demonstrations_due = _DEMONSTRATIONS_DUE.labels(lineage)
        self.sft_steps = _SFT_STEPS.labels(lineage)
        self.sft_loss = _SFT_LOSS.labels(lineage)
        self.current_version = _CURRENT_VERSION.labels(lineage)
        self.pinned = _PINNED.labels(lineage)
        self.backoff = _BACKOFF.labels(lineage)
        self.step_seconds = _STEP_SECONDS.labels(lineage)
        self.swap_seconds = _SWAP_SECONDS.labels(lineage)

        self.canary_candidate = _CANARY_CANDIDATE.labels(lineage)
        self._outcomes: deque[tuple[float, int, int]] = deque()  # (when, trained, set aside)

    def batch(self, trained: int, set_aside: int, window_s: float = 3600.0) -> None:
        """Count a claimed batch's outcome into the last hour's trainable ratio."""
        now = time.monotonic()
        self._outcomes.append((now, trained, set_aside))
        while self._outcomes and self._outcomes[0][0] < now - window_s:
            self._outcomes.popleft()
        kept = sum(t for _, t, _ in self._outcomes)
        total = kept + sum(a for _, _, a in self._outcomes)
        if total:
            _TRAINABLE_RATIO.labels(self.lineage).set(kept / total)

    def canary(self, evidence: Evidence) -> None:
        _CANARY_EPISODES.labels(self.lineage, "candidate").set(evidence.candidate_episodes)
        _CANARY_EPISODES.labels(self.lineage, "baseline").set(evidence.baseline_episodes)
        for arm, mean in (
            ("candidate", evidence.candidate_mean),
            ("baseline", evidence.baseline_mean),
        ):
            _CANARY_REWARD.labels(self.lineage, arm).set(float("nan") if mean is None else mean)

    def canary_decided(self, action: str, reason: str) -> None:
        _CANARY_DECISIONS.labels(self.lineage, action, reason).inc()
        self.canary_candidate.set(0)

    def gate_decided(self, outcome: str) -> None:
        _GATE_DECISIONS.labels(self.lineage, outcome).inc()

    def eval_scored(self, eval_set: str, candidate: float, current: float) -> None:
        _EVAL_SCORE.labels(self.lineage, eval_set, "candidate").set(candidate)
        _EVAL_SCORE.labels(self.lineage, eval_set, "current").set(current)

    def step_failure(self, reason: str) -> None:
        _STEP_FAILURES.labels(self.lineage, reason).inc()

    def skipped(self, reason: str, count: int) -> None:
        _SKIPPED.labels(self.lineage, reason).inc(count)

    def corrected(self, bucket: str, tokens: int, truncated: int, rejected: int) -> None:
        _CORRECTED_TOKENS.labels(self.lineage, bucket, "kept").inc(tokens - rejected)
        _CORRECTED_TOKENS.labels(self.lineage, bucket, "truncated").inc(truncated)
        _CORRECTED_TOKENS.labels(self.lineage, bucket, "rejected").inc(rejected)

    def is_ratio(self, stat: str, value: float) -> None:
        _IS_RATIO.labels(self.lineage, stat).set(value)
