"""Keeping vLLM and the disk in step with Postgres, for one lineage.

Every vLLM has the lineage's retained versions (the current one first); nothing unrecorded of the
lineage is loaded or on disk; versions past `retain_versions` are retired (marked first, so no
rollback can pick them any more), then, `retire_grace_s` later, unloaded everywhere and deleted.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from core import policy, retirement
from core.database import Sessions
from core.vllm import VLLMError
from trainer.config import TrainerSettings
from trainer.vllm import Replicas

log = logging.getLogger("flywheel.trainer")


class Housekeeper:
    def __init__(self, settings: TrainerSettings, sessions: Sessions, vllm: Replicas) -> None:
        self.settings, self.sessions, self.vllm = settings, sessions, vllm
        self.lineage = settings.lineage
        # This lineage's adapters, and nothing else (a lineage name may prefix another's).
        self._mine = re.compile(re.escape(self.lineage) + r"-v\d+")
        self._next_reconcile = 0.0
        settings.adapters_dir.mkdir(parents=True, exist_ok=True)
        for partial in settings.adapters_dir.glob(".*.tmp"):  # a save cut short by a crash
            shutil.rmtree(partial, ignore_errors=True)

    def reconcile_if_due(self) -> None:
        if time.monotonic() >= self._next_reconcile:
            self.reconcile()

    def reconcile(self) -> None:
        s = self.settings
        self._next_reconcile = time.monotonic() + s.reconcile_s
        self.retire_old_versions()
        with self.sessions.begin() as session:
            adapters = policy.versions(session=session, lineage=self.lineage)
        retained = [a for a in adapters if a.retired_at is None]
        recorded = {a.name for a in adapters}
        everywhere = True  # every replica answered, and unloaded every orphan it had
        for url in self.vllm.urls:
            try:
                loaded = self.vllm.loaded(url)
                for a in sorted(retained, key=lambda a: not a.is_current):
                    if a.name not in loaded and Path(a.path).exists():
                        log.info("loading %s into %s (it was missing)", a.name, url)
                        self.vllm.load(url, a.name, a.path)
                for name in loaded - recorded:
                    if self._mine.fullmatch(name) and self._is_orphan(name):
                        self.vllm.unload(url, name)
            except VLLMError as e:
                everywhere = False
                log.warning("could not reconcile %s: %s", url, e)
        if not everywhere:  # a replica may still hold an orphan: a call for it would read its
            return  # directory (vLLM loads lazily), and a missing one crashes vLLM's engine
        for path in s.adapters_dir.glob(f"{self.lineage}-v*"):
            if (
                self._mine.fullmatch(path.name)
                and path.name not in recorded
                and self._is_orphan(path.name)
            ):
                shutil.rmtree(path, ignore_errors=True)

    def retire_old_versions(self) -> None:
        """Retire all but the newest `retain_versions` and the current one: marked first, then,
        `retire_grace_s` later (calls routed to a version just before it was retired may still
        be queued in vLLM), unloaded everywhere, then deleted."""
        with self.sessions.begin() as session:
            retirement.mark_retired(
                session=session, lineage=self.lineage, keep=self.settings.retain_versions
            )
            retired = [
                a
                for a in policy.versions(session=session, lineage=self.lineage)
                if a.retired_at is not None
            ]
        root = self.settings.adapters_dir.resolve()
        graced = datetime.now(UTC) - timedelta(seconds=self.settings.retire_grace_s)
        for a in retired:
            if not Path(a.path).exists():
                continue  # done already
            if a.retired_at is not None and a.retired_at > graced:
                continue  # next time (the reconcile comes every reconcile_s)
            if not Path(a.path).resolve().is_relative_to(root):  # a row edited by hand, or worse
                log.error("not deleting %s (%s): it is outside %s", a.name, a.path, root)
                continue
            try:
                self.vllm.unload_everywhere(a.name)
            except VLLMError as e:
                log.warning(
                    "could not unload %s yet (tried again after the next step): %s", a.name, e
                )
                continue
            shutil.rmtree(a.path, ignore_errors=True)  # only once no vLLM can read it

    def _is_orphan(self, name: str) -> bool:
        """Unrecorded for longer than a lease: no trainer can still be publishing it."""
        path = self.settings.adapters_dir / name
        age = time.time() - path.stat().st_mtime if path.exists() else float("inf")
        return age > self.settings.lease_s
