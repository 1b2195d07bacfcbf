"""Advantages (GRPO): a transition's return, normalised among the samples of the same task.

Each transition carries its credited return. Transitions of episodes that share a task id form a
group (a group needs two episodes or more); a transition's advantage is
(return - group mean) / (group std + eps) over all the group's transitions, as in LightningRL.
A task seen in only one episode has no group: its transitions are compared with a running mean/std
per agent instead (live traffic rarely repeats a task), or set aside, as configured.

A group whose returns are all equal (every attempt failed, or every one succeeded) gives each of
its transitions an advantage of 0: nothing to learn from, and under a token-mean loss its tokens
only dilute the other groups' gradient. `flat_groups` finds them, for the batch to set aside
(DAPO's dynamic-sampling filter; FLYWHEEL_FLAT_GROUPS).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

EPS = 1e-4
FLAT = 1e-9  # returns this close are the same (a group of them has no signal)


@dataclass(frozen=True)
class Scored:
    transition_id: str
    episode_id: str
    task_id: str | None
    agent_name: str | None
    ret: float


@dataclass
class RunningBaseline:
    """Exponentially weighted mean and variance of returns, per agent."""

    momentum: float
    mean: dict[str | None, float] = field(default_factory=dict)
    var: dict[str | None, float] = field(default_factory=dict)

    def advantage(self, agent: str | None, ret: float) -> float:
        if agent not in self.mean:
            self.mean[agent], self.var[agent] = ret, 1.0
            return 0.0  # nothing to compare with yet
        a = (ret - self.mean[agent]) / math.sqrt(self.var[agent] + EPS)
        m = self.momentum
        delta = ret - self.mean[agent]
        self.mean[agent] += (1 - m) * delta
        self.var[agent] = m * (self.var[agent] + (1 - m) * delta * delta)
        return a


def _by_task(items: list[Scored]) -> tuple[dict[str, list[Scored]], list[Scored]]:
    """The task groups (two episodes or more of a task) and the items in none."""
    episodes_by_task: dict[str, set[str]] = defaultdict(set)
    for it in items:
        if it.task_id is not None:
            episodes_by_task[it.task_id].add(it.episode_id)
    groups: dict[str, list[Scored]] = defaultdict(list)
    ungrouped: list[Scored] = []
    for it in items:
        if it.task_id is not None and len(episodes_by_task[it.task_id]) >= 2:
            groups[it.task_id].append(it)
        else:
            ungrouped.append(it)
    return groups, ungrouped


def flat_groups(items: list[Scored]) -> set[str]:
    """The transition ids of the task groups whose every return is the same."""
    groups, _ = _by_task(items)
    return {
        m.transition_id
        for members in groups.values()
        if max(m.ret for m in members) - min(m.ret for m in members) <= FLAT
        for m in members
    }


def group_advantages(
    items: list[Scored], baseline: RunningBaseline | None
) -> tuple[dict[str, float], list[str]]:
    """Advantages by transition id, and the ids set aside (ungrouped, with no baseline)."""
    groups, ungrouped = _by_task(items)
    advantages: dict[str, float] = {}
    for members in groups.values():
        # As in LightningRL: every transition is one sample of its task's group.
        returns = [m.ret for m in members]
        mean = sum(returns) / len(returns)
        std = math.sqrt(sum((r - mean) ** 2 for r in returns) / len(returns))
        for m in members:
            advantages[m.transition_id] = (m.ret - mean) / (std + EPS)

    set_aside = []
    for it in ungrouped:
        if baseline is None:
            set_aside.append(it.transition_id)
        else:
            advantages[it.transition_id] = baseline.advantage(it.agent_name, it.ret)
    return advantages, set_aside
