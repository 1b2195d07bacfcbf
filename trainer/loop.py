"""A lineage's trainer: credited transitions in, a better adapter out, hot-swapped into vLLM.

A `Trainer` trains one lineage: the transitions the proxy served from it (`flywheel trainer`
runs one, or many over one base model: trainer/turns.py). Each step: claim a batch (lease) ->
build samples from the recorded token ids -> one GRPO update with LoRA (TRL's loss) -> save
`DIR/<lineage>-vN` atomically -> load it into every vLLM under the new name -> in one
transaction make N the lineage's current version and mark the batch trained -> retire the
lineage's old versions. Other lineages are other Trainers' business.
A crash anywhere leaves no half-written adapter served and no transition trained twice: claims
expire, partial directories are swept, and versions not recorded in Postgres are unloaded.

The publish is a compare-and-set on the version the step started from: after a rollback (or
another trainer's publish) the trainer takes over the new current version's weights and trains
its batch again from there. A step that raises gives its batch back: a batch that keeps failing
the step is set aside after --max-train-attempts, but Postgres or vLLM failing costs it nothing
and the trainer backs off instead (trainer/faults.py); SIGTERM gives back every claim at once.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from core import canary, naming, pins, policy
from core.database import Sessions
from core.vllm import VLLMError
from trainer import faults, metrics, report
from trainer.canary_watch import CanaryWatch
from trainer.config import TrainerSettings
from trainer.data import demonstrations, store
from trainer.data.advantages import RunningBaseline
from trainer.data.batch import build_batch, staleness_in
from trainer.data.sampling import server_defaults
from trainer.housekeeping import Housekeeper
from trainer.learner import ranks, sft
from trainer.learner.engine import Engine, Snapshot
from trainer.promotion import Gatekeeper
from trainer.vllm import Replicas

log = logging.getLogger("flywheel.trainer")

MOVED_RETRIES = 3  # times a batch is trained again from a version that became current meanwhile


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


class Trainer:
    def __init__(
        self,
        settings: TrainerSettings,
        sessions: Sessions,
        vllm: Replicas,
        *,
        make_engine: Callable[[Path | None], Engine] | None = None,
    ) -> None:
        self.settings, self.sessions, self.vllm = settings, sessions, vllm
        self.make_engine = make_engine or (lambda resume: Engine(settings, resume_from=resume))
        self.lineage = settings.lineage
        self.metrics = metrics.LineageMetrics(self.lineage)
        self.housekeeper = Housekeeper(settings, sessions, vllm)
        self.canary = CanaryWatch(settings, sessions, self.metrics, self.housekeeper)
        with sessions.begin() as session:
            current = policy.current(session=session, lineage=self.lineage)
        resume = Path(current.path) if current and Path(current.path).exists() else None
        log.info(
            "lineage %s: starting from %s",
            self.lineage,
            current.name if current else "the base model",
        )
        self.engine = self.make_engine(resume)
        self.sampling_defaults = server_defaults(settings.generation_config, settings.model)
        self.stops = sft.stop_ids(self.engine.tokenizer, settings.model)
        # The version the engine's weights descend from: a publish succeeds only while it is
        # current (compare-and-set), so a rollback sticks and two trainers never fork the policy.
        self.parent = current.version if current else None
        self.baseline = (
            RunningBaseline(settings.baseline_momentum)
            if settings.ungrouped == "baseline"
            else None
        )
        self.steps = 0
        self._was_pinned = False
        self.backoff = faults.Backoff(
            settings.backoff_s, settings.backoff_max_s, self.metrics.backoff
        )
        self.claims = faults.Claims(sessions, settings.trainer_id)
        self.gatekeeper = Gatekeeper(settings, sessions, vllm, self.metrics)

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Train and publish one batch if there is one: demonstrations (a supervised step) and
        transitions (a GRPO step) as `demonstrations` says. True when a new version was
        published. Postgres or vLLM failing (faults.INFRASTRUCTURE) raises, the batch given back
        first without counting an attempt."""
        s = self.settings
        self.claims.release_held()
        if self._pinned() or self.canary.holds():
            return False
        imitated = False
        if s.demonstrations != "off":
            imitated, due = self._imitate()
            if imitated and s.demonstrations == "first":
                return True
            if due and s.demonstrations == "first":  # due, but another trainer holds them
                return False
        return self._reinforce() or imitated

    def _reinforce(self) -> bool:
        """One GRPO step on credited transitions, if enough are waiting."""
        s = self.settings
        with self.sessions.begin() as session:
            current = policy.current(session=session, lineage=self.lineage)
            claimed = store.claim(
                session=session,
                trainer_id=s.trainer_id,
                lease_s=s.lease_s,
                lineage=self.lineage,
                agents=s.agents,
                tenants=s.tenants,
                limit=s.max_batch_transitions,
                min_episodes=s.min_episodes,
                min_groups=s.min_groups,
                max_attempts=s.max_train_attempts,
                holdout=s.ope_holdout if s.estimates else 0.0,
            )
            self.metrics.queue.set(
                store.queue_depth(
                    session=session, lineage=self.lineage, agents=s.agents, tenants=s.tenants
                )
            )
        if not claimed:
            return False
        ids = [c.id for c in claimed]
        return self._train_from(
            current.version if current else None, ids, "transition", lambda: self._train(claimed)
        )

    def _imitate(self) -> tuple[bool, int]:
        """One supervised step on the lineage's demonstrations due an epoch, if any: (published,
        how many are due an epoch, claimed by anyone)."""
        s = self.settings
        with self.sessions.begin() as session:
            current = policy.current(session=session, lineage=self.lineage)
            claimed = demonstrations.claim(
                session=session,
                trainer_id=s.trainer_id,
                lease_s=s.lease_s,
                lineage=self.lineage,
                tenants=s.tenants,
                epochs=s.sft_epochs,
                limit=s.sft_batch,
                max_attempts=s.max_train_attempts,
            )
            due = demonstrations.due(
                session=session, lineage=self.lineage, tenants=s.tenants, epochs=s.sft_epochs
            )
        self.metrics.demonstrations_due.set(due)
        if not claimed:
            return False, due
        ids = [c.id for c in claimed]
        version = current.version if current else None
        return self._train_from(version, ids, "demonstration", lambda: self._sft(claimed)), due

    def _train_from(
        self, version: int | None, ids: list[str], table: store.Table, train: Callable[[], bool]
    ) -> bool:
        """`train()` from `version` (again from the new current one if it moves meanwhile)."""
        try:
            for _ in range(1 + MOVED_RETRIES):
                self._follow(version)
                try:
                    published = train()
                    break
                except policy.PolicyMoved as moved:
                    log.warning("%s: training the batch again from there", moved)
                    self.metrics.step_failure("policy_moved")
                    version = moved.current
            else:  # rolled back under every try: a race, no fault of the batch's
                self._give_back(ids, reason="policy_moved", attempt=False, table=table)
                return False
        except faults.INFRASTRUCTURE as e:
            self._give_back(ids, reason=faults.reason(e), attempt=False, table=table)
            raise
        if published:
            self.steps += 1
            self.housekeeper.retire_old_versions()
        return published

    def _pinned(self) -> bool:
        """While the lineage is pinned by hand (core/policy.py `pin`) the trainer waits, its
        claims free: nothing it trained could be published. Unpinned, it goes on from the
        pinned version (`_follow`), the transitions credited meanwhile still in its queue."""
        with self.sessions.begin() as session:
            held = pins.pin_of(self.lineage, session=session)
        if (held is not None) != self._was_pinned:
            if held is not None:
                log.warning("%s: not training until it is unpinned", pins.Pinned(held))
            else:
                log.warning("%s unpinned: training again", self.lineage)
        self._was_pinned = held is not None
        self.metrics.pinned.set(self._was_pinned)
        return self._was_pinned

    def _train(self, claimed: list[store.Claimed]) -> bool:
        """One update on the claimed rows from the engine's current weights, then publish."""
        s = self.settings
        ids = [c.id for c in claimed]
        with self.sessions.begin() as session:
            lineage = [a.version for a in policy.versions(session=session, lineage=self.lineage)]
        staleness = staleness_in(lineage, self.parent or policy.BASE_VERSION)
        before = self.engine.snapshot()
        try:  # only what fails here is the batch's fault
            batch = build_batch(
                claimed,
                s,
                staleness=staleness,
                baseline=self.baseline,
                limits=self.engine.limits,
                sampling_defaults=self.sampling_defaults,
            )
            for reason, count in batch.skip_counts.items():
                self.metrics.skipped(reason, count)
            sampled = [staleness(c.policy_version) for c in claimed if c.policy_version is not None]
            if sampled:
                self.metrics.staleness.set(sum(sampled) / len(sampled))
            stats = self.engine.step(batch.samples) if batch.samples else None
        except ranks.StepFailed:  # several processes: the group stops; the batch is charged
            self._give_back(ids, reason="error")
            raise
        except Exception:  # a bad batch must not stop training: it has max_train_attempts
            log.exception("the step failed on a batch of %d transitions; giving it back", len(ids))
            self.engine.restore(before)
            self._give_back(ids, reason="error")
            return False
        if stats is None:
            with self.sessions.begin() as session:
                store.set_aside(batch.skipped, session=session, trainer_id=s.trainer_id)
            self.metrics.batch(0, len(batch.skipped))
            return False
        step = Step(
            ids=list(batch.trained) + list(batch.skipped),
            table="transition",
            finish=partial(store.finish, trained=batch.trained, skipped=batch.skipped),
            stats=lambda swap_s: report.stats_json(batch, stats, swap_s, self.parent),
            report=lambda version, swap_s, rule: report.report_step(
                self.metrics,
                step=self.steps + 1,
                version=version,
                batch=batch,
                stats=stats,
                swap_s=swap_s,
                canary_rule=rule,
            ),
        )
        try:
            return self._publish(step, before)
        except faults.INFRASTRUCTURE:
            self.engine.restore(before)  # the step's caller gives the batch back
            raise

    def _sft(self, claimed: list[demonstrations.ClaimedDemonstration]) -> bool:
        """One supervised step on the claimed demonstrations from the engine's weights, then
        publish (trainer/learner/sft.py)."""
        ids = [c.id for c in claimed]
        before = self.engine.snapshot()
        try:  # only what fails here is the batch's fault
            rendered = sft.render(claimed, self.engine.tokenizer, self.stops, self.engine.limits)
            demos = list(rendered.demos.values())
            stats = self.engine.sft_step(demos) if demos else None
        except ranks.StepFailed:
            self._give_back(ids, reason="error", table="demonstration")
            raise
        except Exception:  # a bad batch must not stop training: it has max_train_attempts
            log.exception(
                "the supervised step failed on %d demonstrations; giving them back", len(ids)
            )
            self.engine.restore(before)
            self._give_back(ids, reason="error", table="demonstration")
            return False
        if stats is None:
            with self.sessions.begin() as session:
                demonstrations.set_aside(rendered.skipped, session=session)
            return False
        step = Step(
            ids=ids,
            table="demonstration",
            finish=partial(
                demonstrations.finish,
                trained=list(rendered.demos),
                skipped=rendered.skipped,
            ),
            stats=lambda swap_s: report.sft_stats_json(len(demos), stats, swap_s, self.parent),
            report=lambda version, swap_s, rule: report.report_sft(
                self.metrics,
                step=self.steps + 1,
                version=version,
                demonstrations=len(demos),
                skipped=rendered.skipped,
                stats=stats,
                swap_s=swap_s,
                canary_rule=rule,
            ),
        )
        try:
            return self._publish(step, before)
        except faults.INFRASTRUCTURE:
            self.engine.restore(before)
            raise

    def _follow(self, version: int | None) -> None:
        """Make the engine start from `version` (None: the base model) if it is not there: after
        a rollback, or another trainer's publish. Its weights and saved optimizer state."""
        if version == self.parent:
            return
        path = None
        if version is not None:
            with self.sessions.begin() as session:
                adapter = policy.get(version, session=session)
            path = Path(adapter.path) if adapter else None
            if path is None or not path.exists():
                log.error("v%d is current but %s is not here: from the base model", version, path)
                path = None
        label = f"v{version}" if version is not None else "the base model"
        log.warning("the policy is %s now: the trainer takes over its weights", label)
        try:
            self.engine.load_adapter(path)
        except (ValueError, RuntimeError) as e:
            log.warning("%s; building a new engine from it", e)
            del self.engine
            gc.collect()
            self.engine = self.make_engine(path)
        self.parent = version

    def _publish(self, step: Step, before: Snapshot) -> bool:
        s, keeper = self.settings, self.gatekeeper
        judgement = keeper.estimate(self.engine, before, self.parent, self.sampling_defaults)
        eval_sets = keeper.eval_sets(judgement)
        with self.sessions.begin() as session:
            version = policy.next_version(session=session)
        name = naming.adapter_name(self.lineage, version)
        final = (s.adapters_dir / name).resolve()
        partial = s.adapters_dir / f".{name}.tmp"
        self.engine.save_adapter(partial)
        os.rename(partial, final)  # vLLM never sees a half-written adapter

        swap_s: float | None = None
        if eval_sets:
            swap_s = self._load(name, final)  # held: loaded, but no alias names it yet
            try:
                keeper.ask(judgement, eval_sets, name, self.parent)
            except faults.INFRASTRUCTURE:  # the step's caller gives the batch back
                self._unload(name)
                shutil.rmtree(final, ignore_errors=True)
                raise
        verdict = keeper.decide(judgement, processes=self.engine.world.size)
        rejected = judgement.rejected(s.gate_fallback)
        # A canary, if canaries are on; an undecided version with the canary fallback opens one
        # whatever they say: real rewards decide what the gate could not.
        canary_fallback = judgement.undecided and s.gate_fallback == "canary"
        rule = s.gate_canary_rule if canary_fallback else s.canary_rule
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
                    lineage=self.lineage,
                    version=version,
                    parent=self.parent,
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
                self.engine.restore(before)
                shutil.rmtree(final, ignore_errors=True)
                raise
            # A reward moved a return, another trainer took over, a canary opened or a pin
            # came: the batch goes back (to be trained at once, or after the decision or the
            # unpin), and none of it is the batch's fault.
            reason = {policy.CanaryOpen: "canary_open", pins.Pinned: "pinned"}
            self._abandon(step, final, before, reason=reason.get(type(e), "lost_claim"))
            return False

        if rejected:
            assert verdict is not None
            keeper.rejected(judgement)
            log.warning("%s rejected by the gate (%s): %s", name, verdict.outcome, verdict.reason)
            self.engine.restore(before)  # training goes on from the current version
            return False
        keeper.published(version, judgement, current=rule is None)
        self.parent = version
        step.report(version, swap_s, rule)
        return True

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

    def _abandon(self, step: Step, adapter_dir: Path, before: Snapshot, *, reason: str) -> None:
        """Undo a step lost to a race: weights back, batch back uncharged, directory gone."""
        self.engine.restore(before)
        self._give_back(step.ids, reason=reason, attempt=False, table=step.table)
        shutil.rmtree(adapter_dir, ignore_errors=True)

    def _give_back(
        self,
        ids: list[str],
        *,
        reason: str,
        attempt: bool = True,
        table: store.Table = "transition",
    ) -> None:
        """`attempt`: the claim counts towards max_train_attempts (only when the batch itself
        failed the step). With Postgres down the claims are held, given back once it answers."""
        self.metrics.step_failure(reason)
        self.claims.give_back(ids, attempt=attempt, table=table)

    def reconcile(self) -> None:
        self.housekeeper.reconcile()

    def release_claims(self) -> None:
        """At shutdown: whatever we still hold goes back to the queue at once, not after the
        lease (and it does not count as an attempt, unless its batch failed the step)."""
        self.claims.release_held()
        with self.sessions.begin() as session:
            n = store.release_all(session=session, trainer_id=self.settings.trainer_id)
        if n:
            log.info("gave back %d claimed transitions", n)
