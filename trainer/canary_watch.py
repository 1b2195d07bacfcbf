"""The trainer's side of a canary release (core/canary.py): while its lineage's candidate is
under test the trainer does not step; it weighs the evidence every `canary_check_s` and carries
out the decision. A hold (the gate's `hold` fallback: a canary on no episode) is decided by the
promotion gate instead, asked again every `gate_hold_check_s` (`rejudge`, the trainer's): pass
promotes the candidate (or opens a canary on it, when canaries are on), fail retires it.

A step from the candidate would build on what may be rolled back, a step from the current version
would be a sibling queued behind it: so the claims stay free until the canary is decided.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from core import canary, policy
from core.database import Sessions
from trainer.config import TrainerSettings
from trainer.gate import Verdict
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
        rejudge: Callable[[canary.Canary], Verdict | None],
    ) -> None:
        self.settings, self.sessions, self.metrics = settings, sessions, metrics
        self.housekeeper, self.rejudge = housekeeper, rejudge
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
        if test.rule.held:
            self._next_check = time.monotonic() + self.settings.gate_hold_check_s
            return self._held(test)
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
        return self._carried_out(test, decision.action)

    def _carried_out(self, test: canary.Canary, action: canary.Action) -> bool:
        """After a promotion or a rollback of `test`: the trainer goes on (False)."""
        if action == "promote":
            self.metrics.current_version.set(test.candidate)
        else:
            self.housekeeper.retire_old_versions()  # the rolled-back candidate: unloaded, deleted
        return False

    def _held(self, test: canary.Canary) -> bool:
        """The held candidate's gate asked again: pass promotes it (a canary opens on it when
        canaries are on), fail retires it, inconclusive waits until `max_s`, then the rule's
        fallback. True while it is still held."""
        verdict = self.rejudge(test)  # None: the gate could not be asked (logged)
        if verdict is None:
            verdict = Verdict("inconclusive", "the gate could not be asked")
        outcome, said = verdict.outcome, verdict.reason
        if outcome == "pass":
            decision = canary.Decision("promote", f"gate pass: {said}", None)
        elif outcome == "fail":
            decision = canary.Decision("rollback", f"gate fail: {said}", None)
        elif test.age_s >= test.rule.max_s:
            decision = canary.Decision(
                test.rule.fallback, f"timeout after {test.age_s:.0f}s: {said}", None
            )
        else:
            log.info("%s: %s still held (%.0fs): %s", self.lineage, test.candidate_name,
                     test.age_s, said)  # fmt: skip
            return True
        then = self.settings.canary_rule if decision.action == "promote" else None
        with self.sessions.begin() as session:
            if not policy.decide_canary(test, decision, session=session, then=then):
                return True  # closed meanwhile (by hand, or another trainer): look again
            policy.restat(
                test.candidate,
                {"gate": {"outcome": outcome, "reason": decision.reason, "held_s": test.age_s}},
                session=session,
            )
        reason = "timeout" if outcome == "inconclusive" else f"gate_{outcome}"
        self.metrics.canary_decided(decision.action, reason)
        self.metrics.gate_decided(outcome)
        log.info(
            "%s: held %s %s after %.0fs: %s",
            self.lineage,
            test.candidate_name,
            "opens a canary"
            if then is not None
            else {"promote": "promoted"}.get(decision.action, "retired"),
            test.age_s,
            decision.reason,
        )
        if then is not None:
            return True  # now a canary: the trainer still waits
        return self._carried_out(test, decision.action)
