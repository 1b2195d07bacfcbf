"""Which recorded transitions are not in Postgres yet, and who waits for them: a reward or an
episode read (`wait`, until they are stored) and durable mode's answers (`watch`, until they are
stored or fsync'd to the journal). The writer (proxy/record/recorder.py) says what happened to
each batch: `journaled` or `stored`.

Bounded: an outage journals every call until Postgres is back, for hours maybe, and each id kept
one by one costs ~0.5 KB. Past `max_ids` ids, journaled ones are forgotten one by one and only
marked in a fixed summary instead, a Bloom filter of their ids and episode ids (1 MiB, allocated
then). The answer that must never be wrong is "stored": a reward told so goes on to add itself
to transitions that are not in Postgres. A Bloom filter never misses what was marked, so a
forgotten transition and its episode always read "maybe not stored" (wait and, in the end, a
503 to retry); others may read so too (a false positive, ~5% with a million marks), which only
costs a retry. Only journaled records are forgotten, never queued ones: those are bounded by the
queue's bytes and the summary's meaning stays simple, "something in the journal". It is cleared
as soon as a question finds the journal empty: every segment is deleted only after its records
are committed, so then everything it marked is stored (and the check and the answer run with no
await between them: no segment can be appended meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from core.record import TransitionRecord
from proxy.record.journal import Journal

# 2**23 bits: with a million ids and episode ids marked, 1 in 20 others reads "maybe".
SUMMARY_BITS = 2**23
UNSTORED_MAX_IDS = 50_000  # FLYWHEEL_WRITER_UNSTORED_MAX_IDS: ~25 MB kept one by one at most


class Pending:
    def __init__(self, journal: Journal, max_ids: int = UNSTORED_MAX_IDS) -> None:
        self._journal, self._max_ids = journal, max_ids
        self._unstored: dict[str, set[str]] = {}  # episode id -> transition ids not in Postgres
        self._unstored_ids: set[str] = set()  # the same ids, all episodes together
        self._summary = bytearray()  # journaled ones past max_ids (empty: none)
        self._watched: dict[str, asyncio.Future[None]] = {}  # durable mode: id -> "it is safe"
        self._waiters = 0  # wait() calls in progress
        self._stored = asyncio.Event()  # set and replaced after every write: "look again"

    @property
    def awaited(self) -> bool:
        """Someone waits for records right now: the writer should not linger."""
        return self._waiters > 0 or bool(self._watched)

    def track(self, records: list[TransitionRecord]) -> None:
        for r in records:
            self._unstored.setdefault(r.episode_id, set()).add(r.id)
            self._unstored_ids.add(r.id)

    @property
    def tracked(self) -> int:
        """Transition ids kept one by one."""
        return len(self._unstored_ids)

    def journaled(self, records: list[TransitionRecord]) -> None:
        """These are in the journal (fsync'd): safe, not stored. Past `max_ids`, kept only in
        the summary."""
        self.settle(records)
        self.track(records)  # (those from a journal found at start-up are new here)
        if len(self._unstored_ids) <= self._max_ids:
            return
        if not self._summary:
            self._summary = bytearray(SUMMARY_BITS // 8)
        for r in records:
            self._forget(r)
            for key in (r.id, r.episode_id):
                for bit in _bits(key):
                    self._summary[bit >> 3] |= 1 << (bit & 7)

    def _current_summary(self) -> bytearray:
        """The summary, cleared first if the journal is empty: all it marked is stored."""
        if self._summary and not (self._journal.pending or self._journal.segments()):
            self._summary = bytearray()
        return self._summary

    def watch(self, transition_ids: list[str]) -> list[asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in transition_ids]
        self._watched.update(zip(transition_ids, futures, strict=True))
        return futures

    async def wait(
        self,
        episode_id: str,
        transition_ids: list[str] | None,
        *,
        timeout: float,
        hurry: Callable[[], None],
    ) -> bool:
        """Until this episode's tracked transitions are stored, or only these (`transition_ids`);
        False after `timeout`. `hurry` tells the writer someone waits."""

        def done() -> bool:
            summary = self._current_summary()
            if transition_ids is not None:
                return self._unstored_ids.isdisjoint(transition_ids) and not any(
                    _marked(summary, t) for t in transition_ids
                )
            return not self._unstored.get(episode_id) and not _marked(summary, episode_id)

        if done():  # (most rewards: their calls were written long ago)
            return True
        deadline = time.monotonic() + timeout
        self._waiters += 1
        hurry()
        try:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                with contextlib.suppress(TimeoutError):  # (the summary clears unannounced)
                    await asyncio.wait_for(self._stored.wait(), min(remaining, 1.0))
            return True
        finally:
            self._waiters -= 1

    def settle(self, records: list[TransitionRecord]) -> None:
        """These are safe (journaled or stored): durable mode's answers may go."""
        if self._watched:
            for r in records:
                future = self._watched.pop(r.id, None)
                if future is not None and not future.done():
                    future.set_result(None)

    def stored(self, records: list[TransitionRecord]) -> None:
        """These are in Postgres."""
        self.settle(records)
        for r in records:
            self._forget(r)
        self._signal()

    def _forget(self, r: TransitionRecord) -> None:
        self._unstored_ids.discard(r.id)
        pending = self._unstored.get(r.episode_id)
        if pending is not None:
            pending.discard(r.id)
            if not pending:
                del self._unstored[r.episode_id]

    def _signal(self) -> None:
        """Waiters look again."""
        self._stored.set()
        self._stored = asyncio.Event()


def _marked(summary: bytearray, key: str) -> bool:
    return bool(summary) and all(summary[b >> 3] & (1 << (b & 7)) for b in _bits(key))


def _bits(key: str) -> tuple[int, int]:
    """Two bits of the summary for a key, from its hash (salted per process: the summary never
    leaves it)."""
    h = hash(key)
    return h % SUMMARY_BITS, (h >> 32) % SUMMARY_BITS
