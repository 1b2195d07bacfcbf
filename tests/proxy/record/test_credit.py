"""Credit assignment against hand computations."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from proxy.record.credit import Step, assign_returns

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def step(position: int, reward: float = 0.0, request: uuid.UUID | None = None) -> Step:
    return Step(uuid.uuid4(), request or uuid.uuid4(), T0 + timedelta(seconds=position), reward)


def test_identical_assignment_gives_every_step_the_final_reward_plus_its_own() -> None:
    steps = [step(0), step(1, reward=0.5), step(2)]
    returns = assign_returns(steps, 1.0, gamma=None)
    assert [returns[s.transition_id] for s in steps] == [1.0, 1.5, 1.0]


def test_discounted_assignment_matches_hand_computation() -> None:
    # positions 0,1,2; step rewards r = [0, 0.5, 0.25]; R = 1; gamma = 0.5
    steps = [step(0), step(1, reward=0.5), step(2, reward=0.25)]
    returns = assign_returns(steps, 1.0, gamma=0.5)
    # G_2 = R + r2 = 1.25 ; G_1 = 0.5 R + r1 + 0.5 r2 = 1.125 ; G_0 = 0.25 R + 0.5 r1 + 0.25 r2
    assert returns[steps[2].transition_id] == pytest.approx(1.25)
    assert returns[steps[1].transition_id] == pytest.approx(1.125)
    assert returns[steps[0].transition_id] == pytest.approx(0.25 + 0.25 + 0.0625)


def test_choices_of_one_call_share_a_position() -> None:
    shared = uuid.uuid4()
    a, b = step(0, request=shared), step(0, reward=1.0, request=shared)
    last = step(1)
    returns = assign_returns([a, b, last], 2.0, gamma=0.5)
    # position 0 of 2: 0.5 * 2 + own + 0.5 * mean(r at position 1 = 0)
    assert returns[a.transition_id] == pytest.approx(1.0)
    assert returns[b.transition_id] == pytest.approx(2.0)
    assert returns[last.transition_id] == pytest.approx(2.0)


def test_order_comes_from_time_not_from_list_order() -> None:
    late, early = step(5), step(1)
    returns = assign_returns([late, early], 1.0, gamma=0.9)
    assert returns[late.transition_id] == pytest.approx(1.0)
    assert returns[early.transition_id] == pytest.approx(0.9)
