"""What a published step tells the operator: its metrics, its log line, and the stats stored
with the adapter version (`adapter_version.stats`, shown by `flywheel adapters list`)."""

from __future__ import annotations

import logging
from collections import Counter

from core import canary
from trainer.data.batch import Batch
from trainer.learner.correction import BUCKETS, Tally
from trainer.learner.engine import StepStats
from trainer.learner.sft import SftStats
from trainer.metrics import LineageMetrics

log = logging.getLogger("flywheel.trainer")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def report_step(
    m: LineageMetrics,
    *,
    step: int,
    version: int,
    batch: Batch,
    stats: StepStats,
    swap_s: float,
    canary_rule: canary.Rule | None,
) -> None:
    m.steps.inc()
    m.trained.inc(len(batch.trained))
    m.batch(len(batch.trained), len(batch.skipped))
    m.reward_mean.set(batch.reward_mean)
    m.loss.set(stats.loss)
    m.clip_fraction.set(stats.clip_fraction)
    if stats.kl is not None:
        m.kl.set(stats.kl)
    for stat in ("mean", "min", "max"):
        m.is_ratio(stat, getattr(stats, f"is_ratio_{stat}"))
    if canary_rule is None:
        m.current_version.set(version)
    else:
        m.canary_candidate.set(version)
    m.step_seconds.observe(stats.seconds)
    m.swap_seconds.observe(swap_s)
    for bucket, tally in stats.by_staleness.items():
        m.corrected(bucket, tally.tokens, tally.truncated, tally.rejected)
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(batch.skip_counts.items())) or "none"
    log.info(
        "%s step %d -> v%d | %d samples, reward %.3f | loss %.4f clip %.3f%s"
        " | IS weight %.3f, ratio [%.2g, %.2g] | %s | train %.2fs swap %.0fms | skipped: %s",
        m.lineage,
        step,
        version,
        len(batch.samples),
        batch.reward_mean,
        stats.loss,
        stats.clip_fraction,
        f" kl {stats.kl:.4f}" if stats.kl is not None else "",
        stats.is_ratio_mean,
        stats.is_ratio_min,
        stats.is_ratio_max,
        correction_summary(stats.by_staleness),
        stats.seconds,
        swap_s * 1000,
        skipped,
    )
    if canary_rule is not None and canary_rule.held:
        log.info("%s v%d is held: served to no one until the gate decides it", m.lineage, version)
    elif canary_rule is not None:
        log.info(
            "%s v%d is a canary: %.0f%% of the lineage's episodes until the reward decides",
            m.lineage,
            version,
            canary_rule.fraction * 100,
        )


def report_sft(
    m: LineageMetrics,
    *,
    step: int,
    version: int,
    demonstrations: int,
    skipped: dict[str, str],
    stats: SftStats,
    swap_s: float,
    canary_rule: canary.Rule | None,
) -> None:
    m.steps.inc()
    m.sft_steps.inc()
    m.sft_loss.set(stats.loss)
    if canary_rule is None:
        m.current_version.set(version)
    else:
        m.canary_candidate.set(version)
    m.step_seconds.observe(stats.seconds)
    m.swap_seconds.observe(swap_s)
    for reason in skipped.values():
        m.skipped(reason, 1)
    log.info(
        "%s step %d -> v%d | supervised: %d demonstrations, %d answer tokens | loss %.4f"
        " | train %.2fs swap %.0fms | set aside: %s",
        m.lineage,
        step,
        version,
        demonstrations,
        stats.tokens,
        stats.loss,
        stats.seconds,
        swap_s * 1000,
        ", ".join(f"{k} {v}" for k, v in sorted(Counter(skipped.values()).items())) or "none",
    )


def sft_stats_json(
    demonstrations: int, stats: SftStats, swap_s: float, parent: int | None
) -> dict[str, object]:
    return {
        "kind": "sft",  # a supervised step on demonstrations (GRPO steps have no kind)
        "parent": parent,
        "demonstrations": demonstrations,
        "tokens": stats.tokens,
        "loss": stats.loss,
        "train_s": stats.seconds,
        "swap_s": swap_s,
    }


def correction_summary(by_staleness: dict[str, Tally]) -> str:
    """Per staleness bucket (versions): tokens, and the share truncated / rejected."""
    parts = []
    for _, _, name in BUCKETS:
        t = by_staleness.get(name)
        if t and t.tokens:
            parts.append(
                f"stale {name}: {t.tokens} tok, trunc {t.truncated / t.tokens:.0%}"
                f" rej {t.rejected / t.tokens:.0%}"
            )
    return "; ".join(parts) or "no tokens"


def stats_json(
    batch: Batch, stats: StepStats, swap_s: float, parent: int | None
) -> dict[str, object]:
    return {
        "kind": "grpo",
        "parent": parent,  # the version it was trained from (None: the base model)
        "samples": len(batch.samples),
        "reward_mean": batch.reward_mean,
        "loss": stats.loss,
        "clip_fraction": stats.clip_fraction,
        "kl": stats.kl,  # to FLYWHEEL_KL_ANCHOR's policy (None: beta 0)
        "is_ratio": [stats.is_ratio_min, stats.is_ratio_mean, stats.is_ratio_max],
        "train_s": stats.seconds,
        "swap_s": swap_s,
        "skipped": dict(batch.skip_counts),
        "by_staleness": {k: vars(v) for k, v in stats.by_staleness.items()},
    }
