"""A trained step on its way to serving: estimated and judged by the gate (trainer/promotion.py),
saved atomically as `DIR/<lineage>-vN`, loaded into every vLLM, then recorded in one transaction
with its batch marked trained (a compare-and-set on the version the step started from: see
core/policy.py `publish`). Lost races (a reward moved a return, another trainer took the batch, a
canary opened, a pin came) abandon the step and give its batch back uncharged.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from core import canary, naming, pins, policy
from core.database import Sessions
from core.evals import EvalSet
from core.vllm import VLLMError
from trainer.config import TrainerSettings
from trainer.data import store
from trainer.evals import Compared
from trainer.learner.engine import Engine, Snapshot
from trainer.promotion import Gatekeeper, Judgement
from trainer.vllm import Replicas

log = logging.getLogger("flywheel.trainer")


@dataclass(frozen=True)
class Step:
    """A trained step on its way to being published: what it trained (a GRPO batch of
    transitions or a supervised one of demonstrations) and how to record and report it."""

    ids: list[str]  # every row it claimed: given back if the publish is abandoned
    table: store.Table
    finish: Callable[..., None]  # store.finish or demonstrations.finish, its rows bound
    stats: Callable[[float], dict[str, object]]  # swap seconds -> adapter_version.stats
    # (version, swap seconds, the canary it opened or None) -> metrics and log line
    report: Callable[[int, float, canary.Rule | None], None]


class Publisher:
    def __init__(
        self,
        settings: TrainerSettings,
        sessions: Sessions,
        vllm: Replicas,
        gatekeeper: Gatekeeper,
        give_back: Callable[..., None],
        sampling_defaults: dict[str, float],
    ) -> None:
        self.settings, self.sessions, self.vllm = settings, sessions, vllm
        self.gatekeeper, self.sampling_defaults = gatekeeper, sampling_defaults
        self._give_back = give_back  # the loop's: counts the failure, hands the claims back

    def publish(
        self, step: Step, engine: Engine, before: Snapshot, parent: int | None
    ) -> int | None:
        """Estimate, save, load (for the gate's questions or to serve), record: the version now
        current or under canary, or None (rejected by the gate, or lost to a race and
        abandoned). PolicyMoved: the weights are back at `before`, the batch still ours."""
        s, keeper = self.settings, self.gatekeeper
        judgement, in_turn_s = Judgement(), 0.0
        if not s.gate_overlap:  # a version the estimate fails is then never loaded
            started = time.perf_counter()
            judgement = keeper.estimate(engine, before, parent, self.sampling_defaults)
            in_turn_s = time.perf_counter() - started
        eval_sets = keeper.eval_sets(judgement)
        with self.sessions.begin() as session:
            version = policy.next_version(session=session)
        name = naming.adapter_name(s.lineage, version)
        final = (s.adapters_dir / name).resolve()
        partial = s.adapters_dir / f".{name}.tmp"
        engine.save_adapter(partial)
        os.rename(partial, final)  # vLLM never sees a half-written adapter

        # At once (FLYWHEEL_GATE_OVERLAP): vLLM loads the version (held: no alias names it yet)
        # and answers its eval sets while the trainer's device makes the estimate, so the
        # version waits for the slower of the two, and the gate costs it only what the estimate
        # takes beyond the load. In turn: the load and the asks after the estimate.
        at_once = s.gate_overlap and s.estimates
        swap_s: float | None = None
        ahead: Future[tuple[float, list[Compared]]] | None = None
        started = time.perf_counter()
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="gate") as pool:
                if eval_sets or at_once:
                    ahead = pool.submit(self._load_and_ask, eval_sets, name, final, parent)
                if at_once:
                    judgement = keeper.estimate(engine, before, parent, self.sampling_defaults)
                if ahead is not None:
                    swap_s, judgement.compared = ahead.result()
            # FLYWHEEL_GATE_EVALS=undecided: the eval sets only now, if the estimate could not
            # decide (in turn, `eval_sets` already knew, and `ahead` asked them)
            late = keeper.eval_sets(judgement) if s.gate_settles_on_evals and at_once else []
            if late:
                if swap_s is None:
                    swap_s = self._load(name, final)
                judgement.compared = keeper.compare(late, name, parent)
            waited = time.perf_counter() - started - (swap_s or 0.0)  # the load is not the gate's
            judgement.seconds = in_turn_s + max(waited, 0.0)
        except Exception:  # vLLM or Postgres away: the step's caller gives the batch back
            if swap_s is not None or (
                ahead is not None and ahead.done() and ahead.exception() is None
            ):
                self._unload(name)
            shutil.rmtree(final, ignore_errors=True)
            raise
        verdict = keeper.decide(judgement)
        rejected = judgement.rejected(s.gate_fallback)
        # A canary, if canaries are on; an undecided version with the canary fallback opens one
        # whatever they say (real rewards decide what the gate could not), with the hold
        # fallback it is held: loaded, served to no one, the gate asked again (canary_watch.py).
        rule = s.canary_rule
        if judgement.undecided and s.gate_fallback == "canary":
            rule = s.gate_canary_rule
        elif judgement.undecided and s.gate_fallback == "hold":
            rule = s.gate_hold_rule
        if rejected and swap_s is not None:
            self._unload(name)
        elif not rejected and swap_s is None:  # a rejected version is kept for a look, unloaded
            swap_s = self._load(name, final)
        swap_s = 0.0 if rejected or swap_s is None else swap_s
        # Postgres failing in here raises: whether it committed is unknown, so `final` stays
        # (committed: the next step follows it; not: reconcile unloads and deletes it).
        try:
            with self.sessions.begin() as session:
                publication = store.Publication(
                    lineage=s.lineage,
                    version=version,
                    parent=parent,
                    path=str(final),
                    base_model=str(s.model),
                    stats=step.stats(swap_s) | judgement.stats(),
                    canary_rule=rule,
                    rejected=rejected,
                )
                step.finish(session=session, trainer_id=s.trainer_id, publication=publication)
        except (store.LostClaim, policy.PolicyMoved, policy.CanaryOpen, pins.Pinned) as e:
            log.warning("discarding %s: %s", name, e)
            self._unload(name)
            if isinstance(e, policy.PolicyMoved):  # the batch stays ours, to train again
                engine.restore(before)
                shutil.rmtree(final, ignore_errors=True)
                raise
            # A reward moved a return, another trainer took over, a canary opened or a pin
            # came: the batch goes back (to be trained at once, or after the decision or the
            # unpin), and none of it is the batch's fault.
            reason = {policy.CanaryOpen: "canary_open", pins.Pinned: "pinned"}
            self._abandon(step, engine, final, before, reason=reason.get(type(e), "lost_claim"))
            return None

        if rejected:
            assert verdict is not None
            keeper.rejected(judgement)
            log.warning("%s rejected by the gate (%s): %s", name, verdict.outcome, verdict.reason)
            engine.restore(before)  # training goes on from the current version
            return None
        keeper.published(version, judgement, current=rule is None)
        step.report(version, swap_s, rule)
        return version

    def _load_and_ask(
        self, eval_sets: list[EvalSet], name: str, final: Path, parent: int | None
    ) -> tuple[float, list[Compared]]:
        """The new version loaded into every vLLM and asked its eval sets: the load's seconds and
        the scores. Unloaded again if the asks fail."""
        swap_s = self._load(name, final)
        try:
            compared = self.gatekeeper.compare(eval_sets, name, parent) if eval_sets else []
        except Exception:
            self._unload(name)
            raise
        return swap_s, compared

    def _load(self, name: str, final: Path) -> float:
        """Load the new version into every vLLM: the seconds it took."""
        try:
            rollout = self.vllm.load_everywhere(name, str(final))
        except VLLMError as e:  # NoReplica, AdapterRejected: the batch is not to blame
            log.error("could not load %s; the alias stays where it was: %s", name, e)
            shutil.rmtree(final, ignore_errors=True)
            raise
        for url in rollout.unreachable:
            log.warning("vLLM %s unreachable, %s not loaded there (reconcile will)", url, name)
        return rollout.seconds

    def _unload(self, name: str) -> None:
        try:
            self.vllm.unload_everywhere(name)
        except VLLMError as e:  # reconcile unloads it once it is an orphan
            log.warning("could not unload %s yet: %s", name, e)

    def _abandon(
        self, step: Step, engine: Engine, adapter_dir: Path, before: Snapshot, *, reason: str
    ) -> None:
        """Undo a step lost to a race: weights back, batch back uncharged, directory gone."""
        engine.restore(before)
        self._give_back(step.ids, reason=reason, attempt=False, table=step.table)
        shutil.rmtree(adapter_dir, ignore_errors=True)
