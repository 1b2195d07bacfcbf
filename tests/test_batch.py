"""Staleness counts the trained lineage's own versions (trainer/data/batch.py)."""

from __future__ import annotations

from trainer.data.batch import staleness_in


def test_staleness_counts_only_the_lineages_own_publishes() -> None:
    # The writer's versions are 1, 4 and 9: numbers 2, 3 and 5-8 went to other lineages.
    staleness = staleness_in([1, 4, 9], current=9)
    assert staleness(9) == 0
    assert staleness(4) == 1  # one writer version since (not 5 numbers)
    assert staleness(1) == 2
    assert staleness(0) == 3  # sampled from the base model
    # After a rollback to v4, what v9 sampled is not "stale" by a negative amount.
    assert staleness_in([1, 4, 9], current=4)(9) == 0
    assert staleness_in([], current=0)(0) == 0
