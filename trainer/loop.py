"""A lineage's trainer: credited transitions in, a better adapter out, hot-swapped into vLLM.

A `Trainer` trains one lineage: the transitions the proxy served from it (`flywheel trainer`
runs one, or many over one base model: trainer/turns.py). Each step: claim a batch (lease) ->
build samples from the recorded token ids -> one GRPO update with LoRA (TRL's loss), or a
supervised one on demonstrations -> publish (trainer/publisher.py: saved, loaded into every vLLM,
made current with the batch marked trained in one transaction) -> retire old versions.
A crash anywhere leaves no half-written adapter served and no transition trained twice: claims
expire, partial directories are swept, and versions not recorded in Postgres are unloaded.
After a rollback (or another trainer's publish) the trainer takes over the new current version's
weights and trains its batch again from there. A batch that keeps failing the step is set aside
after --max-train-attempts, but Postgres or vLLM failing costs it nothing and the trainer backs
off instead (trainer/faults.py); SIGTERM gives back every claim at once.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

from core import canary, policy
from core.database import Sessions
from trainer import faults, gate, metrics, report
from trainer.canary_watch import CanaryWatch
from trainer.config import TrainerSettings
from trainer.data import demonstrations, store
from trainer.data.advantages import RunningBaseline
from trainer.data.batch import build_batch, staleness_in
from trainer.data.sampling import server_defaults
from trainer.housekeeping import Housekeeper
from trainer.learner import ranks, sft
from trainer.learner.engine import Engine, Snapshot
from trainer.pin_watch import PinWatch
from trainer.promotion import Gatekeeper
from trainer.publisher import Publisher, Step
from trainer.vllm import Replicas

log = logging.getLogger("flywheel.trainer")

MOVED_RETRIES = 3  # times a batch is trained again from a version that became current meanwhile


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
        self.canary = CanaryWatch(
            settings, sessions, self.metrics, self.housekeeper, rejudge=self._rejudge
        )
        self.pin = PinWatch(self.lineage, sessions, self.metrics)
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
        self.backoff = faults.Backoff(
            settings.backoff_s, settings.backoff_max_s, self.metrics.backoff
        )
        self.claims = faults.Claims(sessions, settings.trainer_id)
        self.gatekeeper = Gatekeeper(settings, sessions, vllm, self.metrics)
        self.publisher = Publisher(
            settings, sessions, vllm, self.gatekeeper, self._give_back, self.sampling_defaults
        )

    def step(self) -> bool:
        """Train and publish one batch if there is one: demonstrations (a supervised step) and
        transitions (a GRPO step) as `demonstrations` says. True when a new version was
        published. Postgres or vLLM failing (faults.INFRASTRUCTURE) raises, the batch given back
        first without counting an attempt."""
        s = self.settings
        self.claims.release_held()
        if self.pin.holds() or self.canary.holds():
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
        return bool(claimed) and self._train_from(
            current, [c.id for c in claimed], "transition", lambda: self._train(claimed)
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
        ids = [c.id for c in claimed]
        trained = bool(claimed) and self._train_from(
            current, ids, "demonstration", lambda: self._sft(claimed)
        )
        return trained, due

    def _train_from(
        self,
        current: policy.Adapter | None,
        ids: list[str],
        table: store.Table,
        train: Callable[[], bool],
    ) -> bool:
        """`train()` from the `current` version (again from the new current one if it moves
        meanwhile)."""
        version = current.version if current else None
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
        return self._publish(step, before)

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
        return self._publish(step, before)

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

    def _rejudge(self, held: canary.Canary) -> gate.Verdict | None:
        """A held version's gate asked again (canary_watch.py), from the current version."""
        self._follow(None if held.baseline == policy.BASE_VERSION else held.baseline)
        return self.gatekeeper.rejudge(self.engine, held, self.parent, self.sampling_defaults)

    def _publish(self, step: Step, before: Snapshot) -> bool:
        try:
            version = self.publisher.publish(step, self.engine, before, self.parent)
        except faults.INFRASTRUCTURE:
            self.engine.restore(before)  # the step's caller gives the batch back
            raise
        if version is None:
            return False
        self.parent = version
        return True

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
        self.claims.release_all()
