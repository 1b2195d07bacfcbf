"""Digests of messages and token id blocks this process knows are committed, so the writer does
not send them again (a system prompt or an episode's history repeats in batch after batch).

Forgotten when full (`STORED_MAX`), after an outage (the database may come back restored from a
backup) and when the UTC day changes: what a batch was sent on marks each used until at least
that day, and retention deletes them by their `last_used` day (core/retention.py), keeping every
one used within a day of the oldest transition it keeps.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, date, datetime

STORED_MAX = 200_000


class KnownDigests:
    def __init__(self, max_size: int = STORED_MAX) -> None:
        self._max = max_size
        self._day = date.min  # the UTC day the digests hold for
        self.digests: set[bytes] = set()

    def today(self) -> date:
        """The day a write begins on (a new day forgets the old one's digests)."""
        day = datetime.now(UTC).date()
        if day != self._day:
            self.digests.clear()
            self._day = day
        return day

    def committed(self, sent: Collection[bytes], day: date) -> None:
        if len(self.digests) + len(sent) > self._max:
            self.digests.clear()
        if day == self._day:  # (another writer may have begun the next day meanwhile)
            self.digests.update(sent)

    def forget(self) -> None:
        self.digests.clear()
