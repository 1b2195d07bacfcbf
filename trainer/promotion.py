"""What a new version shows before it serves (issue 42, docs/promotion.md): its off-policy
estimate on logged traffic (FLYWHEEL_OPE, trainer/candidate.py), its eval sets' scores
(FLYWHEEL_EVALS, trainer/evals.py), and the promotion gate's verdict on them (FLYWHEEL_GATE,
trainer/gate.py). The trainer's publish (trainer/publisher.py) asks a lineage's `Gatekeeper`
for its `estimate` (the trainer's forward passes) and its `compare` (the version loaded in vLLM,
served by no alias yet, asked its eval sets), at once (FLYWHEEL_GATE_OVERLAP) or in turn, then
to `decide`; and tells it what was `published`. A version held by the
gate (FLYWHEEL_GATE_FALLBACK=hold) is judged again by `rejudge` (trainer/canary_watch.py).

Under torchrun / accelerate launch the engine is rank 0's `Led` (trainer/learner/ranks.py): the
estimate's forward passes are dealt out to every rank, and the rest is rank 0's alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import canary, policy
from core.database import Sessions
from core.evals import EvalSet
from core.evals import sets as eval_sets_of
from trainer import candidate, evals, faults, gate
from trainer.config import TrainerSettings
from trainer.data import logged
from trainer.evals import Compared
from trainer.learner.engine import Engine, Snapshot
from trainer.metrics import LineageMetrics
from trainer.vllm import Replicas

log = logging.getLogger("flywheel.trainer")


@dataclass
class Judgement:
    """What is known of one new version before it serves."""

    judged: candidate.Evaluated | None = None  # the estimate (None: not made)
    estimated: gate.Verdict | None = None  # the gate's verdict on it (None: it reads none)
    compared: list[Compared] = field(default_factory=list)  # its eval sets
    verdict: gate.Verdict | None = None  # the gate's (None: no gate)
    seconds: float = 0.0  # the estimate and the asks as made, at once or in turn (wall)

    @property
    def failed_estimate(self) -> bool:
        return self.estimated is not None and self.estimated.outcome == "fail"

    @property
    def estimate_undecided(self) -> bool:
        return self.estimated is not None and self.estimated.outcome == "inconclusive"

    @property
    def undecided(self) -> bool:
        return self.verdict is not None and self.verdict.outcome == "inconclusive"

    def rejected(self, fallback: str) -> bool:
        return self.verdict is not None and (
            self.verdict.outcome == "fail" or (self.undecided and fallback == "reject")
        )

    def stats(self) -> dict[str, object]:
        """What the version's stats keep of it: `ope`, `evals`, `gate`."""
        out: dict[str, object] = {"ope": self.judged.stats()} if self.judged else {}
        if self.compared:
            out["evals"] = {c.name: c.stats() for c in self.compared}
        if self.verdict is not None:
            out["gate"] = {"outcome": self.verdict.outcome, "reason": self.verdict.reason}
        if self.judged or self.compared:
            out["judged_s"] = round(self.seconds, 3)
        return out


class Gatekeeper:
    def __init__(
        self,
        settings: TrainerSettings,
        sessions: Sessions,
        vllm: Replicas,
        metrics: LineageMetrics,
    ) -> None:
        self.settings, self.sessions, self.vllm, self.metrics = settings, sessions, vllm, metrics
        self.lineage = settings.lineage
        # The current version's scores of logged calls, from its own estimate as the candidate
        # (candidate.Evaluated.scores): the next estimate asks the engine only for the others.
        self._scored: tuple[int, dict[str, float]] | None = None

    def estimate(
        self,
        engine: Engine,
        before: Snapshot,
        parent: int | None,
        sampling_defaults: dict[str, float],
    ) -> Judgement:
        """The engine's new weights estimated against `before`, the current version's (when
        FLYWHEEL_OPE or the gate asks), and the gate's verdict on the estimate."""
        s = self.settings
        judgement = Judgement()
        if not s.estimates:
            return judgement
        current = parent if parent is not None else policy.BASE_VERSION
        with self.sessions.begin() as session:
            calls = logged.window(
                session=session,
                lineage=self.lineage,
                version=current,
                tenants=s.tenants,
                episodes=s.ope_episodes,
                max_age_s=s.ope_max_age_s,
                versions=s.ope_max_versions,
            )
        known = self._scored[1] if self._scored and self._scored[0] == current else None
        try:
            judgement.judged = candidate.evaluate(
                engine,
                engine.at(before),
                calls,
                s,
                current_version=current,
                sampling_defaults=sampling_defaults,
                limits=engine.limits,
                known=known,
            )
        except Exception:  # the estimate is a report: it must not cost the step
            log.exception("ope: the estimate failed")
        else:
            log.info("%s: %s", self.lineage, judgement.judged.line())
        if "ope" in s.gate:
            judgement.estimated = gate.decide(
                judgement.judged,
                margin=s.gate_margin,
                min_weight=s.gate_min_weight,
                min_ess=s.ope_min_ess,
            )
        return judgement

    def eval_sets(self, judgement: Judgement) -> list[EvalSet]:
        """The lineage's eval sets, when they are to be asked (not of a version the estimate
        failed already: it is never loaded; with FLYWHEEL_GATE_OVERLAP the estimate is made
        while they are asked, and `judgement` is still empty; with FLYWHEEL_GATE_EVALS=undecided
        only once the estimate could not decide)."""
        s = self.settings
        if not s.asks_evals or judgement.failed_estimate:
            return []
        if s.gate_settles_on_evals and not judgement.estimate_undecided:
            return []
        with self.sessions.begin() as session:
            return eval_sets_of(session=session, lineage=self.lineage)

    def rejudge(
        self,
        engine: Engine,
        held: canary.Canary,
        baseline: int | None,
        sampling_defaults: dict[str, float],
    ) -> gate.Verdict | None:
        """A held version judged again on the traffic logged since (the engine at `baseline`'s
        weights, the current version's; None: the base model): the held weights loaded for a
        new estimate and put back, its eval sets' stored scores reused (a set added meanwhile is
        asked: it is loaded), its stats updated, the gate's verdict. None: it could not be
        asked now."""
        with self.sessions.begin() as session:
            adapter = policy.get(held.candidate, session=session)
        if adapter is None or not Path(adapter.path).exists():
            where = adapter.path if adapter else "no row"
            return gate.Verdict("fail", f"its adapter is gone ({where})")
        before = engine.snapshot()
        try:
            engine.load_adapter(Path(adapter.path))
            started = time.perf_counter()
            judgement = self.estimate(engine, before, baseline, sampling_defaults)
            eval_sets = self.eval_sets(judgement)
            if eval_sets:
                judgement.compared = self.compare(eval_sets, adapter.name, baseline, adapter.stats)
            judgement.seconds = time.perf_counter() - started  # in turn: it serves no one yet
            self.decide(judgement)
        except faults.INFRASTRUCTURE as e:  # Postgres or vLLM away: the hold waits
            log.warning("%s: the held %s is not judged yet: %s", self.lineage, adapter.name, e)
            return None
        finally:
            engine.restore(before)
        with self.sessions.begin() as session:
            policy.restat(held.candidate, judgement.stats(), session=session)
        return judgement.verdict

    def compare(
        self,
        eval_sets: list[EvalSet],
        name: str,
        parent: int | None,
        candidate_stats: dict[str, Any] | None = None,
    ) -> list[Compared]:
        """The loaded new version `name` asked the eval sets (a score in `candidate_stats` for
        the same set and judge is reused), beside the current version's scores. vLLM failing to
        answer raises (faults.INFRASTRUCTURE). It touches neither the engine nor the judgement:
        the publisher runs it beside the estimate (FLYWHEEL_GATE_OVERLAP)."""
        current = parent if parent is not None else policy.BASE_VERSION
        with self.sessions.begin() as session:
            adapter = policy.get(current, session=session) if parent is not None else None
        compared = evals.compare(
            self.vllm,
            eval_sets,
            candidate=name,
            current=adapter.name if adapter else self.vllm.base_model(),
            current_version=current,
            current_stats=adapter.stats if adapter else None,
            candidate_stats=candidate_stats,
            settings=self.settings,
        )
        for c in compared:
            self.metrics.eval_scored(c.name, c.candidate.score, c.current.score)
        if compared:
            log.info("%s: %s", self.lineage, evals.line(compared))
        return compared

    def decide(self, judgement: Judgement) -> gate.Verdict | None:
        """The promotion gate's verdict (None: no gate)."""
        s = self.settings
        if s.gate == "off":
            return None
        verdicts = [judgement.estimated] if judgement.estimated is not None else []
        if "evals" in s.gate:
            verdicts.append(gate.from_evals(judgement.compared, margin=s.gate_eval_margin))
        if s.gate_settles_on_evals and len(verdicts) == 2:
            judgement.verdict = gate.settle(*verdicts)
        else:
            judgement.verdict = gate.combine(verdicts)
        log.info(
            "%s: gate %s: %s", self.lineage, judgement.verdict.outcome, judgement.verdict.reason
        )
        return judgement.verdict

    def published(self, version: int, judgement: Judgement, *, current: bool) -> None:
        """`version` is published (`current`: made the lineage's current version at once)."""
        if judgement.verdict is not None:
            self.metrics.gate_decided(judgement.verdict.outcome)
        judged = judgement.judged
        self._scored = (version, judged.scores) if judged and current else None

    def rejected(self, judgement: Judgement) -> None:
        assert judgement.verdict is not None
        self.metrics.gate_decided(judgement.verdict.outcome)
