"""The trainer's side of a pin (core/pins.py): while its lineage is pinned by hand the trainer
waits, its claims free, since nothing it trained could be published. Unpinned, it goes on from
the pinned version (the loop's `_follow`), the transitions credited meanwhile still in its queue.
"""

from __future__ import annotations

import logging

from core import pins
from core.database import Sessions
from trainer.metrics import LineageMetrics

log = logging.getLogger("flywheel.trainer")


class PinWatch:
    def __init__(self, lineage: str, sessions: Sessions, metrics: LineageMetrics) -> None:
        self.lineage, self.sessions, self.metrics = lineage, sessions, metrics
        self._was_pinned = False

    def holds(self) -> bool:
        """Whether the lineage is pinned now (logged when that changes)."""
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
