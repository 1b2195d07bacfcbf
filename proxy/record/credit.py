"""Credit assignment (LightningRL): from an episode's final reward to a return per transition.

Positions are calls in the order they were made; the `n` choices of one call share a position
(they are alternative actions, not consecutive ones).
- identical (gamma=None, the paper's default): G = R + the transition's own intermediate rewards.
- discounted: G_p = gamma^(T-1-p) * R + sum_{k>=p} gamma^(k-p) * r_k, where r_p is the
  transition's own intermediate reward and r_k (k > p) the mean over position k's choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID


@dataclass(frozen=True)
class Step:
    transition_id: UUID
    request_id: UUID
    requested_at: datetime
    step_reward: float  # sum of the intermediate rewards posted for this transition


def assign_returns(
    steps: list[Step], final_reward: float, gamma: float | None
) -> dict[UUID, float]:
    if gamma is None:
        return {s.transition_id: final_reward + s.step_reward for s in steps}

    first_seen: dict[UUID, datetime] = {}
    for s in steps:
        first_seen[s.request_id] = min(first_seen.get(s.request_id, s.requested_at), s.requested_at)
    order = sorted(first_seen, key=lambda rid: (first_seen[rid], str(rid)))
    position = {rid: p for p, rid in enumerate(order)}
    T = len(order)

    by_position: list[list[float]] = [[] for _ in range(T)]
    for s in steps:
        by_position[position[s.request_id]].append(s.step_reward)
    mean_r = [sum(rs) / len(rs) for rs in by_position]

    # future_p = sum_{k>p} gamma^(k-p) * mean_r[k], computed backwards.
    future = [0.0] * T
    for p in range(T - 2, -1, -1):
        future[p] = gamma * (mean_r[p + 1] + future[p + 1])

    return {
        s.transition_id: gamma ** (T - 1 - position[s.request_id]) * final_reward
        + s.step_reward
        + future[position[s.request_id]]
        for s in steps
    }
