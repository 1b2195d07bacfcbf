"""Whose fault a failed step was, and how long the trainer waits after one that was not its batch's.

Only a batch's own failure (an exception while building or training it) counts towards
`max_train_attempts`: a batch that breaks the step every time is set aside as `train_failed`
rather than stall the queue. Everything else is the infrastructure's, and costs the batch nothing:

    Postgres not answering (core.database.OUTAGE_ERRORS)   the claims go back uncharged (held
    every vLLM unreachable, or refusing the adapter       until Postgres answers), and the
      (core.vllm.VLLMError: NoReplica, AdapterRejected)    trainer backs off
    a claim lost to a reward or another trainer,         the claims go back uncharged, and the
      the policy moved under every retry, a pin or canary  next step tries at once (a race)

Without this, three steps in a vLLM outage set the oldest credited transitions aside for good.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Gauge

from core.database import OUTAGE_ERRORS, Sessions
from core.vllm import AdapterRejected, VLLMError
from trainer.data import store

log = logging.getLogger("flywheel.trainer")

INFRASTRUCTURE = (VLLMError, *OUTAGE_ERRORS)


def reason(error: BaseException) -> str:
    """The `reason` label of flywheel_trainer_step_failures_total for an infrastructure error."""
    if isinstance(error, AdapterRejected):  # vLLM's configuration (--max-lora-rank, say)
        return "adapter_rejected"
    return "vllm_unavailable" if isinstance(error, VLLMError) else "database_unavailable"


class Backoff:
    """Exponential: `base_s` after the first infrastructure failure in a row, doubling up to
    `max_s`; back to nothing once a step gets through. `gauge` shows the wait in progress."""

    def __init__(self, base_s: float, max_s: float, gauge: Gauge) -> None:
        self.base_s, self.max_s, self.gauge = base_s, max_s, gauge
        self.failures = 0

    @property
    def delay_s(self) -> float:
        if not self.failures:
            return 0.0
        return min(self.max_s, self.base_s * 2.0 ** min(self.failures - 1, 62))

    def wait_after(self, error: BaseException) -> None:
        self.failures += 1
        self.gauge.set(self.delay_s)
        log.warning("%s; trying again in %.1f s", error, self.delay_s)
        time.sleep(self.delay_s)

    def reset(self) -> None:
        self.failures = 0
        self.gauge.set(0)


class Claims:
    """Claims on their way back to the queue: with Postgres down they are held, and given back
    (uncharged, or charged if their batch failed) before the trainer claims anything again."""

    def __init__(self, sessions: Sessions, trainer_id: str) -> None:
        self.sessions, self.trainer_id = sessions, trainer_id
        # (ids, counts as an attempt, their table)
        self.held: list[tuple[list[str], bool, store.Table]] = []

    def give_back(
        self, ids: list[str], *, attempt: bool, table: store.Table = "transition"
    ) -> None:
        self.held.append((ids, attempt, table))
        try:
            self.release_held()
        except OUTAGE_ERRORS as e:
            log.warning("%d claims go back once Postgres answers: %s", len(ids), e)

    def release_all(self) -> None:
        """At shutdown: whatever the trainer still holds goes back to the queue at once, not
        after the lease (and it does not count as an attempt, unless its batch failed the
        step)."""
        self.release_held()
        with self.sessions.begin() as session:
            n = store.release_all(session=session, trainer_id=self.trainer_id)
        if n:
            log.info("gave back %d claimed transitions", n)

    def release_held(self) -> None:
        """Raises OUTAGE_ERRORS while Postgres does not answer."""
        while self.held:
            ids, attempt, table = self.held[0]
            with self.sessions.begin() as session:
                store.release(
                    ids, session=session, trainer_id=self.trainer_id, attempt=attempt, table=table
                )
            self.held.pop(0)
