"""The trainer's side of a canary release (core/canary.py): while its lineage's candidate is
under test the trainer does not step; it weighs the evidence every `canary_check_s` and carries
out the decision.

A step from the candidate would build on what may be rolled back, a step from the current version
would be a sibling queued behind it: so the claims stay free until the canary is decided.
"""

from __future__ import annotations

import logging
import time

from core import canary, policy
from core.database import Sessions
from trainer.config import TrainerSettings
from trainer.housekeeping import Housekeeper
from trainer.metrics import LineageMetrics
from trainer.report import fmt

log = logging.getLogger("flywheel.trainer")


class CanaryWatch:
    def __init__(
        self,
        settings: TrainerSettings,
        sessions: Sessions,
        metrics: LineageMetrics,
        housekeeper: Housekeeper,
    ) -> None:
        self.settings, self.sessions, self.metrics = settings, sessions, metrics
        self.housekeeper = housekeeper
        self.lineage = settings.lineage
        self._next_check = 0.0

    def holds(self) -> bool:
        """True while the lineage has an open canary (tested here when a check is due)."""
        with self.sessions.begin() as session:
            test = canary.opened(session=session, lineage=self.lineage).get(self.lineage)
        if test is None:
            return False
        self.metrics.canary_candidate.set(test.candidate)
        if time.monotonic() < self._next_check:
            return True
        self._next_check = time.monotonic() + self.settings.canary_check_s
        with self.sessions.begin() as session:
            arms = canary.evidence_rows(test, session=session)
        evidence = canary.weigh(*arms, test.rule)
        self.metrics.canary(evidence)
        decision = canary.decide(evidence, test.rule, test.age_s)
        if decision is None:
            return True
        with self.sessions.begin() as session:
            if not policy.decide_canary(test, decision, session=session):
                return True  # closed meanwhile (by hand, or another trainer): look again
        self.metrics.canary_decided(decision.action, decision.reason)
        log.info(
            "%s canary %s: %s (%s) after %.0fs | candidate %d episodes, reward %s"
            " | baseline v%d %d episodes, reward %s | p(worse) %s p(not worse) %s",
            self.lineage,
            test.candidate_name,
            decision.action,
            decision.reason,
            test.age_s,
            evidence.candidate_episodes,
            fmt(evidence.candidate_mean),
            test.baseline,
            evidence.baseline_episodes,
            fmt(evidence.baseline_mean),
            fmt(evidence.p_worse),
            fmt(evidence.p_not_worse),
        )
        if decision.action == "promote":
            self.metrics.current_version.set(test.candidate)
        else:
            self.housekeeper.retire_old_versions()  # the rolled-back candidate: unloaded, deleted
        return False
