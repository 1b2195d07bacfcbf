"""`flywheel trainer`: one lineage, or many in one process over one copy of the base model.

    flywheel trainer --model BASE_MODEL_DIR --vllm URL --adapters-dir DIR [--lineage L]
    flywheel trainer ... --lineages acme.policy,globex.policy     # these lineages
    flywheel trainer ... --lineages '*.policy'                    # every tenant's `policy`

Each lineage is a `Trainer` (trainer/loop.py: its adapter, optimizer state, claims, baseline,
canary and housekeeping); the second and later are PEFT adapters on the first one's base model
(`Engine(base=...)`), so a lineage costs its adapter and optimizer state, not another copy of
the weights. `Turns.run` steps them in turn, one step each per turn, so a busy lineage never
starves a quiet one. A pattern (`*` in a name) takes in every lineage that matches as soon as it
has credited transitions waiting or a current version (checked every `lineage_discover_s`).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server
from sqlalchemy import text

from core import database, policy
from core.database import Sessions
from core.tables import TRAINABLE
from trainer import faults
from trainer.config import TrainerSettings
from trainer.learner import distributed, ranks
from trainer.learner.engine import Engine
from trainer.loop import Trainer
from trainer.vllm import Replicas

log = logging.getLogger("flywheel.trainer")


class Stopping(BaseException):
    """SIGTERM: leave the step where it is (nothing half-published survives a crash either)."""


def _stop(signum: int, _frame: object) -> None:
    raise Stopping(signal.Signals(signum).name)


def run(settings: TrainerSettings) -> None:
    launcher = distributed.from_launcher(os.environ)  # accelerate launch's config, if any
    if launcher:
        settings = TrainerSettings.model_validate(settings.model_dump() | launcher)
        # the base is sharded here (shard_base); TRL's Accelerator must not set up FSDP too
        os.environ.pop("ACCELERATE_USE_FSDP", None)
    world = distributed.join(settings.rank_timeout_s)
    if settings.shard_base and world.size == 1:
        raise SystemExit(
            "flywheel trainer: shard_base shards the base model over the processes of torchrun "
            "or accelerate launch (docs/scaling.md); one process alone has nothing to shard over"
        )
    signal.signal(signal.SIGTERM, _stop)  # kubectl delete, docker stop: claims go back at once
    try:
        if not world.leader:  # under torchrun / accelerate launch (trainer/learner/ranks.py)
            try:
                ranks.follow(settings)
            except (Stopping, KeyboardInterrupt):
                log.info("stopped")
            return
        try:
            lead(settings, world)
        except ranks.RanksLost as e:  # the claims went back (Turns.run); the launcher restarts
            log.error("stopping: %s", e)
            raise SystemExit(1) from e
        if world.size > 1:
            ranks.stop_followers()
    finally:
        distributed.leave()


def lead(settings: TrainerSettings, world: distributed.World) -> None:
    url = database.resolve_url(settings.database_url, settings.home)
    database.migrate(url)
    db, sessions = database.create_sessions(url)
    vllm = Replicas(
        settings.vllm,
        settings.vllm_api_key.get_secret_value() if settings.vllm_api_key else None,
    )
    try:
        turns = Turns(settings, sessions, vllm, world=world)
        if settings.metrics_port:  # opened once the engines are built: it doubles as readiness
            start_http_server(settings.metrics_port)
        turns.run()
    except (Stopping, KeyboardInterrupt):
        log.info("stopped")
    finally:
        vllm.close()
        db.dispose()


class Turns:
    """The lineages this process trains, on one base model, and the loop that steps them."""

    def __init__(
        self,
        settings: TrainerSettings,
        sessions: Sessions,
        vllm: Replicas,
        *,
        trainers: list[Trainer] | None = None,  # built elsewhere: these, and no others
        world: distributed.World | None = None,
    ) -> None:
        self.settings, self.sessions, self.vllm = settings, sessions, vllm
        self.world = world or distributed.World(0, 1)
        names = [] if trainers else settings.lineages or [settings.lineage]
        self.patterns = [n for n in names if "*" in n]
        self.trainers: list[Trainer] = list(trainers or [])
        self._base: Any = self.trainers[0].engine.model if self.trainers else None
        self._next_discovery = 0.0
        for name in names:
            if "*" not in name:
                self.add(name)
        self.discover()

    def add(self, lineage: str) -> Trainer:
        """A Trainer for `lineage`, its engine beside the others' (the first one's base)."""
        settings = self.settings.for_lineage(lineage)
        if self._base is None:
            engine = self._engines(settings, None, "default")
            trainer = Trainer(settings, self.sessions, self.vllm, make_engine=engine)
            self._base = trainer.engine.model
            if len(self.settings.lineages) > 1 or self.patterns:  # a rebuild stays on the base
                trainer.make_engine = self._engines(settings, self._base, "default")
        else:
            adapter = f"lineage{len(self.trainers)}"  # PEFT's name for it (no dots)
            engine = self._engines(settings, self._base, adapter)
            trainer = Trainer(settings, self.sessions, self.vllm, make_engine=engine)
        self.trainers.append(trainer)
        return trainer

    def discover(self) -> list[Trainer]:
        """Trainers for lineages that match a pattern, have work or a version, and have none."""
        if not self.patterns:
            return []
        self._next_discovery = time.monotonic() + self.settings.lineage_discover_s
        with self.sessions.begin() as session:
            waiting = session.scalars(
                text(f"SELECT DISTINCT lineage FROM transition WHERE {TRAINABLE}")
            ).all()
            versioned = policy.currents(session=session).keys()
        have = {t.lineage for t in self.trainers}
        found = sorted(
            name
            for name in {*waiting, *versioned} - have
            if name and any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
        )
        if found:
            log.info("lineages found: %s", ", ".join(found))
        return [self.add(name) for name in found]

    def run(self) -> None:
        """Each lineage's next step in turn, until every lineage found has made max_steps (or
        SIGTERM/SIGINT: Stopping); then every claim goes back. Postgres or vLLM failing is every
        lineage's problem: the turn ends and that lineage backs off."""
        max_steps, poll_s = self.settings.max_steps, self.settings.poll_s
        try:
            while True:
                if self.world.size > 1:  # each turn, busy or not (trainer/learner/ranks.py)
                    ranks.heartbeat()
                if time.monotonic() >= self._next_discovery:
                    try:
                        self.discover()
                    except faults.INFRASTRUCTURE as e:
                        log.warning("could not look for new lineages: %s", e)
                due = [t for t in self.trainers if max_steps is None or t.steps < max_steps]
                if not due and self.trainers:  # each has made max_steps
                    return
                published = False
                for trainer in due:
                    try:
                        trainer.housekeeper.reconcile_if_due()
                        published = trainer.step() or published
                    except faults.INFRASTRUCTURE as e:  # the batch went back uncharged (step)
                        trainer.backoff.wait_after(e)
                        break
                    trainer.backoff.reset()
                else:
                    if not published:
                        time.sleep(poll_s)
        finally:
            for trainer in self.trainers:
                trainer.release_claims()

    def _engines(
        self, settings: TrainerSettings, base: Any, adapter: str
    ) -> Callable[[Path | None], Any]:
        """A Trainer's `make_engine`: an Engine, or on rank 0 of several one the others follow."""
        if self.world.size > 1:
            return ranks.led(settings, base=base, adapter=adapter)
        return lambda resume: Engine(settings, resume_from=resume, base=base, adapter=adapter)
