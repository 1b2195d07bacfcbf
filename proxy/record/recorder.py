"""The background writer: recorded transitions reach Postgres in batches, never on a request's path.

- `submit()` is synchronous and cheap; writer tasks (`WRITERS`, two) drain the queue. While
  batches are written, the next accumulate, so batches grow with load. At low load a writer
  lingers up to `linger_s` after the oldest queued record for more to join it (a write costs
  about the same CPU for one transition as for ten); it writes at once when the batch is full,
  or when someone waits for the records: a reward, an episode read, durable mode, shutdown.
- Postgres unreachable (or a write hanging): the batch goes to the disk journal, later batches
  follow it there, and the journal is replayed once Postgres answers again.
- Postgres refusing a row as data (SQLSTATE 22, 23, 54) isolates it in the journal's rejected/;
  its neighbours are written. Other refusals (read-only, privileges) are outages: core/database.py
- The journal failing (disk full, read-only, I/O error): the records go back to the queue, in
  memory, and are tried again (Postgres first) every `retry_s`; `journal_error` says why, for
  /healthz. Nothing acknowledged is dropped while the process lives.
- Rewards and episode reads call `wait_stored()` first, so a reward posted after its completion's
  response always finds the transition in Postgres.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from pathlib import Path

import orjson

from core.codecs import PromptMemo
from core.database import OUTAGE_ERRORS, AsyncSessions, refusals_as_outage, write_deadline
from core.record import TransitionRecord
from proxy import metrics
from proxy.record import reward_journal
from proxy.record.journal import Journal
from proxy.record.known import KnownDigests
from proxy.record.pending import UNSTORED_MAX_IDS, Pending
from proxy.record.queue import RecordQueue
from proxy.record.replay import REPLAY_CHUNK, ReplayChunks
from proxy.record.store.transitions import insert_transitions
from proxy.record.tracing import Spans

log = logging.getLogger(__name__)

# Batches written at once, each on its own connection: while Postgres writes one, Python packs
# the next (either side alone leaves the other idle for about half of the time).
WRITERS = 2
# How long a reward or an episode read waits for this process's transitions to leave the queue.
STORED_WAIT_S = 10.0


class Recorder:
    def __init__(
        self,
        sessionmaker: AsyncSessions,
        journal: Journal,
        *,
        batch_size: int,
        linger_s: float = 0.0,
        queue_max_bytes: int,
        retry_s: float,
        gamma: float | None,
        air_penalty: float | None = None,
        spans: Spans | None = None,
        memo: PromptMemo | None = None,  # (its bounds: FLYWHEEL_WRITER_MEMO_*)
        replay: ReplayChunks | None = None,  # (and every write's timeout)
        unstored_max_ids: int = UNSTORED_MAX_IDS,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._spans = spans  # every record accepted is also a span (FLYWHEEL_OTEL_ENDPOINT)
        self.journal = journal
        self._batch_size = batch_size
        self._linger_s = linger_s
        self._queue_max_bytes = queue_max_bytes
        self._retry_s = retry_s
        self._gamma = gamma
        self._air_penalty = air_penalty
        self._queue = RecordQueue()
        self._pending = Pending(journal, unstored_max_ids)  # not in Postgres yet, who waits
        self._replaying = False
        self._known = KnownDigests()  # what need not be sent again (proxy/record/known.py)
        self._memo = PromptMemo() if memo is None else memo  # each episode's last prompt, hashed
        self._chunks = replay or ReplayChunks()  # how much of the journal one write replays
        self._timeout_s = self._chunks.timeout_s
        self._wake = asyncio.Event()
        self._hurry = asyncio.Event()  # "write now": see _urgent()
        self._stopping = False
        self._next_replay = 0.0
        self._task: asyncio.Task[None] | None = None
        self._database_ok = True  # the last write (or replay) reached Postgres
        self._journal_retry_at = 0.0
        for segment in journal.segments():  # an unreadable one is replayed later, or fails then
            with self.journal.guard("read"):
                self._pending.journaled(journal.read(segment))
        metrics.journal_pending.set(journal.pending)
        metrics.journal_ok.set(1)

    @property
    def database_up(self) -> bool:
        """The last write reached Postgres and nothing waits in the journal."""
        return self._database_ok and not self.journal.pending

    @property
    def at_risk(self) -> bool:
        """Records have nowhere durable to go: Postgres and the journal both fail."""
        return self.journal_error is not None and not self._database_ok

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        metrics.writer_unsaved.set_function(lambda: self._queue.unsaved)
        self._task = asyncio.create_task(self._run(), name="flywheel-writer")

    def expect(self, records: list[TransitionRecord]) -> None:
        """Records on their way here (being scored, proxy/relay/scoring.py): rewards and episode
        reads wait for them as for records already queued."""
        self._pending.track(records)

    def watch(self, transition_ids: list[str]) -> list[asyncio.Future[None]]:
        """Durable mode: futures done once each transition is committed or journaled (fsync'd).
        Call it before the records are submitted (a spill may settle them at once)."""
        futures = self._pending.watch(transition_ids)
        self._hurry.set()
        return futures

    def submit(self, records: list[TransitionRecord]) -> None:
        if self._spans is not None:
            self._spans.emit(records)
        self._pending.track(records)
        self._queue.extend(records)
        if (
            self._queue.nbytes > self._queue_max_bytes
            and time.monotonic() >= self._journal_retry_at
        ):  # Postgres is slow (or down): to disk before the memory runs out
            self._journal(self._queue.take_all())  # on failure they are back in the queue
        self._queue.report()
        self._wake.set()
        if len(self._queue) >= self._batch_size:
            self._hurry.set()

    async def wait_stored(
        self, episode_id: str, transition_ids: list[str] | None = None, *, timeout: float
    ) -> bool:
        """Wait until this episode's transitions recorded here are in Postgres, or only these
        (`transition_ids`, which may be another episode's: the reward route says so then)."""
        return await self._pending.wait(
            episode_id, transition_ids, timeout=timeout, hurry=self._hurry.set
        )

    async def stop(self, timeout: float = 30.0) -> None:
        """Flush everything to Postgres, or to the journal if Postgres can't take it in time."""
        self._stopping = True
        self._wake.set()
        self._hurry.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        except Exception:  # the writer should not die; if it did, still save what is left
            log.exception("the writer failed; saving what is left to the journal")
        leftover = [r for batch in self._queue.in_flight.values() for r in batch]
        leftover += self._queue.take_all()
        self._queue.in_flight.clear()
        if leftover and not self._journal(leftover):
            log.critical(
                "%d recorded transitions could be written neither to Postgres nor to the journal "
                "(%s) and are lost with this process",
                len(leftover),
                self.journal_error,
            )

    # --- the writer task ------------------------------------------------------------------

    async def _run(self) -> None:
        await asyncio.gather(*(self._writer(i) for i in range(WRITERS)))
        if self.journal.pending:  # a last batch may have failed after the others finished
            await self._replay()

    async def _writer(self, index: int) -> None:
        while True:
            try:
                if await self._writer_step(index):
                    return
            except Exception:  # a bug: the batch goes back, the writer lives on
                log.exception("writer %d failed; its batch goes back to the queue", index)
                self._queue.put_back(self._queue.in_flight.pop(index, []))
                await asyncio.sleep(self._retry_s)

    async def _writer_step(self, index: int) -> bool:
        """One batch (or none): True once stopping and nothing is left."""
        if not self._queue and not self._stopping:
            wait = self._retry_s if self.journal.pending else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
            self._wake.clear()
        if self.journal.pending and time.monotonic() >= self._next_replay:
            await self._replay()
        await self._linger()
        batch = self._queue.take(self._batch_size)
        self._queue.report()
        if self._queue:
            self._wake.set()  # more than one batch waiting: wake the other writer too
        if batch:
            self._queue.in_flight[index] = batch
            if self.journal.pending and not self.journal.failing("append"):
                kept = self._journal(batch)  # keep going behind the journal until it is replayed
            else:
                kept = await self._write(batch)
            del self._queue.in_flight[index]  # written, journaled, or back in the queue
            if not kept:
                await asyncio.sleep(self._retry_s)  # neither works: try Postgres again then
        return self._stopping and not self._queue

    def _urgent(self) -> bool:
        return self._stopping or self._pending.awaited or len(self._queue) >= self._batch_size

    async def _linger(self) -> None:
        """Wait for more records to share this write, until `linger_s` after the oldest one
        queued, unless the batch is full or someone waits for it (_urgent)."""
        while self._queue and not self._urgent():
            remaining = self._queue.since + self._linger_s - time.monotonic()
            if remaining <= 0:
                return
            self._hurry.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), remaining)

    async def _write(self, batch: list[TransitionRecord]) -> bool:
        """Into Postgres, else the journal; False: neither, the batch is back in the queue."""
        try:
            await self._insert(batch)
        except OUTAGE_ERRORS as e:
            log.warning("Postgres unreachable (%s); journaling %d transitions", e, len(batch))
            self._next_replay = time.monotonic() + self._retry_s
            self._database_ok = False
            metrics.database_up.set(0)
            return self._journal(batch)
        except Exception:
            await self._isolate(batch)
            return True
        self._pending.stored(batch)
        self._database_ok = True
        metrics.database_up.set(1)
        return True

    async def _insert(self, records: list[TransitionRecord]) -> None:
        today = self._known.today()
        try:
            async with (
                refusals_as_outage(),  # a read-only standby, say: wait, it is not the rows' fault
                write_deadline(self._timeout_s),  # a hung Postgres holds it no longer
                self._sessionmaker.begin() as session,
            ):
                sent = await insert_transitions(
                    records,
                    session=session,
                    gamma=self._gamma,
                    air_penalty=self._air_penalty,
                    stored=self._known.digests,
                    today=today,
                    memo=self._memo,
                )
        except OUTAGE_ERRORS:
            self._known.forget()
            raise
        self._known.committed(sent, today)  # the block above exited cleanly
        metrics.writer_memo_bytes.set(self._memo.nbytes)
        for r in records:
            metrics.transitions_recorded.labels(r.status).inc()

    async def _isolate(self, batch: list[TransitionRecord]) -> None:
        """One bad row must not cost its neighbours: write them one by one."""
        for record in batch:
            try:
                await self._insert([record])
            except OUTAGE_ERRORS:
                self._journal([record])
                continue
            except Exception as e:
                log.exception("Postgres refused transition %s; kept in rejected/", record.id)
                metrics.transitions_rejected.inc()
                with self.journal.guard("reject"):
                    self.journal.reject(record, repr(e))
                if self.journal.failing("reject"):  # the log is the last place it can go
                    log.error("rejected transition %s: %s", record.id, orjson.dumps(record))
            self._pending.stored([record])

    async def _replay(self) -> None:
        if self._replaying:  # the other writer is at it
            return
        self._replaying = True
        try:
            if not await self._replay_segments() or time.monotonic() < self._next_replay:
                return  # (the last call at a stop comes early: no wait on a known outage)
            if await reward_journal.replay_rewards(
                self.journal, self._sessionmaker, gamma=self._gamma, timeout_s=self._timeout_s
            ):
                log.info("journal replayed; Postgres is back")
                self._database_ok = True
                metrics.database_up.set(1)
                return
            self._next_replay = time.monotonic() + self._retry_s
            if not self.journal.failing("read"):  # Postgres, not the disk: it is still down
                self._database_ok = False
                metrics.database_up.set(0)
        finally:
            self._replaying = False

    def journal_rewards(self, post: reward_journal.Entry) -> bool:
        """A reward post to the journal, behind the queued transitions (False: journal failing)."""
        if self._queue and not self._journal(self._queue.take_all()):
            return False
        self._wake.set()  # a writer idle on an empty queue replays it once Postgres answers
        return reward_journal.append(self.journal, post)

    async def _replay_segments(self) -> bool:
        """The journaled transitions into Postgres, oldest first; False: not all of them yet.
        (Postgres is up again only once the rewards journaled behind them are applied too.)"""
        segments = deque(self.journal.segments())
        while segments:
            # Consecutive segments together (each batch journaled under load is a segment of a
            # few records: one transaction each could not keep up with the traffic arriving).
            group: list[tuple[Path, int]] = []
            records: list[TransitionRecord] = []
            while segments and (not group or len(records) < REPLAY_CHUNK):
                segment = segments.popleft()
                with self.journal.guard("read"):
                    read = self.journal.read(segment)
                if self.journal.failing("read"):
                    self._next_replay = time.monotonic() + self._retry_s
                    return False
                group.append((segment, len(read)))
                records += read
            try:  # chunk by chunk, sized by bytes and time (proxy/record/replay.py)
                await self._chunks.insert(group[0][0], records, self._insert, self._pending.stored)
            except OUTAGE_ERRORS:
                self._next_replay = time.monotonic() + self._retry_s
                self._database_ok = False
                metrics.database_up.set(0)
                return False
            except Exception:
                await self._isolate(records)  # (each one stored, rejected or journaled again)
            for segment, count in group:
                with self.journal.guard("remove"):  # a segment left behind only replays again
                    self.journal.remove(segment, count)
            metrics.journal_pending.set(self.journal.pending)
        return True

    def _journal(self, records: list[TransitionRecord]) -> bool:
        """To disk; if the journal fails, back to the front of the queue (False)."""
        with self.journal.guard("append"):
            self.journal.append(records)
            metrics.transitions_journaled.inc(len(records))
            metrics.journal_pending.set(self.journal.pending)
            self._pending.journaled(records)
            return True
        self._queue.put_back(records)
        self._queue.report()
        self._journal_retry_at = time.monotonic() + self._retry_s
        return False

    @property
    def journal_error(self) -> str | None:
        """Why the journal is failing (None: its last operations worked)."""
        return self.journal.error
