"""The record wing's door: what the relay hands a finished call's records to, and the one module of
proxy/record/ the relay may import (a contract in pyproject.toml).

The recording decision, for the records of one call (one per choice, `records[0].status` says how
the call ended):
- durable mode (FLYWHEEL_DURABLE): a successful answer is released only once its records are
  committed or fsync'd to the journal (`watch`, then `safe`); after `durable_wait_s` (both
  Postgres and the journal failing) it is released all the same, and counted;
- what Postgres cannot hold is made storable (a U+0000: storable.py);
- with AIR on, a successful record's tool calls are checked against the request's tools
  (air.py): what is wrong is stored with it (`tool_errors`) and becomes an `air` reward;
then `submit` queues them for the writer (recorder.py). A record the relay has scored first
(its logprobs asked of vLLM: proxy/relay/scoring.py) is `expect`ed meanwhile, so that a reward
naming it waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from core.record import TransitionRecord
from proxy import metrics
from proxy.record.air import ToolCheck
from proxy.record.recorder import Recorder
from proxy.record.storable import has_nul, pg_safe, pg_safe_record

log = logging.getLogger(__name__)


class Intake:
    def __init__(
        self,
        recorder: Recorder,
        *,
        tool_check: ToolCheck | None = None,
        durable_wait_s: float | None = None,
    ) -> None:
        self._recorder = recorder
        self._tool_check = tool_check  # AIR (air.py); None: off
        self._durable_wait_s = durable_wait_s  # None: durable mode off

    def watch(self, records: list[TransitionRecord]) -> list[asyncio.Future[None]]:
        """Durable mode, a successful call: futures done once its records are safe (none else).
        Before `submit`: a spill to the journal may settle them at once."""
        if self._durable_wait_s is None or records[0].status != "ok":
            return []
        return self._recorder.watch([r.id for r in records])

    def prepare(
        self, records: list[TransitionRecord], *, tools: Any, scrub: bool
    ) -> list[TransitionRecord]:
        """The records as they are stored. `tools`: the request's (None: it declared none);
        `scrub`: the request held a U+0000."""
        if scrub or any(has_nul(r) for r in records):
            records = [pg_safe_record(r) for r in records]
        if self._tool_check is not None and tools is not None:
            for r in records:
                if r.status == "ok":
                    errors = self._tool_check.errors(tools, r)
                    for error in errors or ():
                        metrics.tool_call_errors.labels(error["kind"]).inc()
                    # (a schema holding a U+0000 may be quoted in a detail)
                    r.tool_errors = pg_safe(errors) if scrub else errors
        return records

    def submit(self, records: list[TransitionRecord]) -> None:
        """To the writer: never awaited, never on the client's path."""
        self._recorder.submit(records)

    def expect(self, records: list[TransitionRecord]) -> None:
        """Records on their way (being scored): rewards and episode reads wait for them."""
        self._recorder.expect(records)

    async def safe(self, watched: list[asyncio.Future[None]]) -> None:
        """Durable mode: wait until the watched records are committed or journaled."""
        if not watched:
            return
        _, waiting = await asyncio.wait(watched, timeout=self._durable_wait_s)
        if waiting:
            log.warning(
                "released a response before its transitions were safe (%d waiting): "
                "Postgres and the journal both fail",
                len(waiting),
            )
            metrics.durable_timeouts.inc()
