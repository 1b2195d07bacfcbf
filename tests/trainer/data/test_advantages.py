"""GRPO advantages against hand computations."""

from __future__ import annotations

import pytest

from trainer.data.advantages import EPS, RunningBaseline, Scored, flat_groups, group_advantages


def scored(tid: str, episode: str, task: str | None, ret: float, agent: str = "a") -> Scored:
    return Scored(tid, episode, task, agent, ret)


def test_a_task_group_is_normalised_by_hand() -> None:
    # task t: episodes e1 (two calls, return 1) and e2 (one call, return 0)
    items = [scored("1", "e1", "t", 1.0), scored("2", "e1", "t", 1.0), scored("3", "e2", "t", 0.0)]
    advantages, aside = group_advantages(items, baseline=None)
    mean = 2 / 3
    std = ((2 * (1 - mean) ** 2 + mean**2) / 3) ** 0.5
    assert advantages["1"] == pytest.approx((1 - mean) / (std + EPS))
    assert advantages["3"] == pytest.approx((0 - mean) / (std + EPS))
    assert aside == []


def test_equal_returns_give_zero_advantage() -> None:
    items = [scored("1", "e1", "t", 0.5), scored("2", "e2", "t", 0.5)]
    assert group_advantages(items, baseline=None)[0] == {"1": 0.0, "2": 0.0}


def test_ungrouped_use_the_running_baseline_or_are_set_aside() -> None:
    items = [scored("1", "e1", None, 1.0), scored("2", "e2", "only-once", 0.0)]
    advantages, aside = group_advantages(items, baseline=None)
    assert advantages == {} and aside == ["1", "2"]

    baseline = RunningBaseline(momentum=0.5)
    advantages, aside = group_advantages(items, baseline)
    assert aside == []
    assert advantages["1"] == 0.0  # first return seen for agent "a": the baseline starts there
    # second: mean 1.0, var 1.0 -> (0 - 1) / sqrt(1 + eps)
    assert advantages["2"] == pytest.approx(-1 / (1 + EPS) ** 0.5)
    assert baseline.mean["a"] == pytest.approx(0.5)


def test_baselines_are_per_agent() -> None:
    baseline = RunningBaseline(momentum=0.9)
    baseline.advantage("planner", 10.0)
    assert baseline.advantage("solver", 0.0) == 0.0  # solver's own first sample
    assert baseline.advantage("planner", 10.0) == pytest.approx(0.0)


def test_a_group_whose_attempts_all_earned_the_same_is_flat() -> None:
    items = [
        scored("1", "e1", "failed", 0.0),
        scored("2", "e2", "failed", 0.0),
        scored("3", "e3", "solved", 1.0),
        scored("4", "e4", "solved", 1.0),
        scored("5", "e5", "mixed", 1.0),
        scored("6", "e6", "mixed", 0.0),
        scored("7", "e7", "alone", 0.0),  # no group: the baseline's, never flat
    ]
    assert flat_groups(items) == {"1", "2", "3", "4"}
