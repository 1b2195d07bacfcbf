"""How much of the journal one replay transaction takes (proxy/record/recorder.py `_replay`).

A chunk is cut by bytes (`record_bytes`, the writer queue's measure: long prompts make few
records a lot of work), at most `REPLAY_CHUNK` records, and at least one. Its budget adapts to how
long chunks take against the write timeout: halved after a chunk that timed out or took over
half of it, doubled (up to `max_bytes`) after one that took under a quarter. So a journal of long
prompts replays in chunks that finish, instead of one chunk timing out again and again, and the
budget comes back once Postgres is fast again (after a partition, say). Where a replay stopped
in a segment is kept, so the next one starts at the first chunk not yet committed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from core.record import TransitionRecord
from proxy.record.queue import record_bytes

WRITE_TIMEOUT_S = 15.0  # a write hanging longer than this is an outage: journal and move on
REPLAY_CHUNK = 5000  # records
# FLYWHEEL_JOURNAL_REPLAY_CHUNK_BYTES: ~800k prompt tokens, a few seconds of COPY at most.
REPLAY_CHUNK_BYTES = 32 * 2**20


class ReplayChunks:
    def __init__(
        self, max_bytes: int = REPLAY_CHUNK_BYTES, *, timeout_s: float = WRITE_TIMEOUT_S
    ) -> None:
        self.max_bytes = self.budget = max_bytes
        self.timeout_s = timeout_s  # every write's, the writer's as well (FLYWHEEL_WRITE_TIMEOUT_S)
        # A segment, how many of its records are committed and the last one's id (a segment
        # rewritten meanwhile, quarantine's doing, starts again from its first record).
        self._resume: tuple[Path, int, str] | None = None

    async def insert(
        self,
        segment: Path,
        records: list[TransitionRecord],
        insert: Callable[[list[TransitionRecord]], Awaitable[None]],
        committed: Callable[[list[TransitionRecord]], None],
    ) -> None:
        """The segment's records, chunk by chunk, each in its own `insert` (a transaction), told
        to `committed` as soon as it is. Raises what `insert` raises."""
        start = 0
        if self._resume is not None and self._resume[0] == segment:
            _, start, last_id = self._resume
            start = start if start <= len(records) and records[start - 1].id == last_id else 0
        while start < len(records):
            end, size = start, 0
            while end < len(records) and end - start < REPLAY_CHUNK:
                size += record_bytes(records[end])
                if size > self.budget and end > start:
                    break
                end += 1
            began = time.monotonic()
            try:
                await insert(records[start:end])
            except TimeoutError:
                self.budget = max(1, self.budget // 2)
                raise
            took = time.monotonic() - began
            if took > self.timeout_s / 2:
                self.budget = max(1, self.budget // 2)
            elif took < self.timeout_s / 4:
                self.budget = min(self.max_bytes, self.budget * 2)
            committed(records[start:end])
            start = end
            self._resume = (segment, start, records[start - 1].id)
        self._resume = None
