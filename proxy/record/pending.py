"""Which recorded transitions are not in Postgres yet, and who waits for them: a reward or an
episode read (`wait`, until they are stored) and durable mode's answers (`watch`, until they are
stored or fsync'd to the journal). The writer (proxy/record/recorder.py) says what happened to
each batch: `settle` (journaled) or `stored`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from core.record import TransitionRecord


class Pending:
    def __init__(self) -> None:
        self._unstored: dict[str, set[str]] = {}  # episode id -> transition ids not in Postgres
        self._unstored_ids: set[str] = set()  # the same ids, all episodes together
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
            if transition_ids is not None:
                return self._unstored_ids.isdisjoint(transition_ids)
            return not self._unstored.get(episode_id)

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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stored.wait(), remaining)
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
            self._unstored_ids.discard(r.id)
            pending = self._unstored.get(r.episode_id)
            if pending is not None:
                pending.discard(r.id)
                if not pending:
                    del self._unstored[r.episode_id]
        self._stored.set()
        self._stored = asyncio.Event()
