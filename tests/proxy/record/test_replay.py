"""Outage bookkeeping and replay stay bounded (issue 31, item 3): a journal of long prompts is
replayed in chunks sized by bytes and halved when one times out, so replay finishes under a short
write timeout; the writer's record of what is not stored yet stays bounded however much is
journaled, and never says "stored" for a transition that is not in Postgres.

Postgres is real (slowed by a trigger that sleeps for each token block it inserts: a write's time
grows with its prompts' bytes, as on a loaded server) or a port nothing listens on (an outage).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from core import database
from core.database import AsyncSessions
from core.record import TransitionRecord
from fakes.traffic import episode_records
from proxy.record.journal import Journal
from proxy.record.pending import Pending
from proxy.record.recorder import Recorder
from proxy.record.replay import ReplayChunks

SLOW_BLOCKS = """
CREATE FUNCTION slow_block() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN PERFORM pg_sleep(0.001); RETURN NEW; END $$;
CREATE TRIGGER slow_block BEFORE INSERT ON token_block FOR EACH ROW EXECUTE FUNCTION slow_block();
"""


def one_call_records(n: int, prompt_tokens: int = 10, seed: int = 1) -> list[TransitionRecord]:
    """`n` one-call episodes (fresh ids, as calls without X-Episode-Id get)."""
    rng = random.Random(seed)
    template = episode_records(rng, turns=1)[0]
    records = []
    for _ in range(n):
        records.append(
            dataclasses.replace(
                template,
                id=str(uuid.uuid4()),
                request_id=str(uuid.uuid4()),
                episode_id=f"ep-{uuid.uuid4().hex}",
                prompt_token_ids=[rng.randrange(150_000) for _ in range(prompt_tokens)],
            )
        )
    return records


async def settle(condition: Any, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_a_journal_of_long_prompts_replays_under_a_short_write_timeout(
    database_url: str, tmp_path: Path
) -> None:
    """40 calls of 5,120-token prompts (800 blocks, 1 ms each: ~1 s in one transaction) under a
    0.5 s write timeout, from a chunk budget that takes them all at once: chunks that time out
    are halved until they finish, and every record reaches Postgres (before: the one chunk of
    up to 5,000 records timed out again and again, for ever)."""
    with psycopg.connect(database.libpq_url(database_url), autocommit=True) as conn:
        conn.execute(SLOW_BLOCKS)
    journal = Journal(tmp_path)
    records = one_call_records(40, prompt_tokens=5120)
    journal.append(records)  # one segment, as a spill of the queue writes it
    engine, sessionmaker = database.create_async_sessions(database_url)
    recorder = Recorder(
        sessionmaker,
        journal,
        batch_size=500,
        queue_max_bytes=2**30,
        retry_s=0.1,
        gamma=None,
        replay=ReplayChunks(64 * 2**20, timeout_s=0.5),
    )
    recorder.start()
    try:
        await settle(lambda: journal.pending == 0, timeout=60)
        assert await recorder.wait_stored(records[0].episode_id, [r.id for r in records], timeout=5)
    finally:
        await recorder.stop(timeout=5)
        await engine.dispose()
    with psycopg.connect(database.libpq_url(database_url)) as conn:
        row = conn.execute("SELECT count(*) FROM transition").fetchone()
    assert row is not None and row[0] == len(records)
    assert not journal.segments()


@pytest.mark.slow
async def test_outage_bookkeeping_is_bounded_and_never_says_stored(
    postgres_down: AsyncSessions, tmp_path: Path
) -> None:
    """30,000 one-call episodes journaled while Postgres is down: the writer keeps 1,000 ids one
    by one (its setting here) and a fixed summary for the rest, a few MiB in all (before: every
    id, ~0.5 KB each, until replay); each journaled transition and its episode still read "not
    stored"."""
    journal = Journal(tmp_path)
    recorder = Recorder(
        postgres_down,
        journal,
        batch_size=500,
        queue_max_bytes=2**30,
        retry_s=1000,  # no replay tried meanwhile: a segment read back would be counted
        gamma=None,
        unstored_max_ids=1000,
    )
    recorder.start()
    sample: list[tuple[str, str]] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(60):
            batch = one_call_records(500)
            sample += [(r.episode_id, r.id) for r in batch[::50]]
            recorder.submit(batch)
            await settle(lambda: recorder.queue_depth == 0, timeout=30)
            del batch
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    try:
        assert journal.pending == 30_000
        assert held < 4 * 2**20, held  # ~15 MB before
        for episode_id, transition_id in sample:
            assert not await recorder.wait_stored(episode_id, [transition_id], timeout=0)
            assert not await recorder.wait_stored(episode_id, timeout=0)
    finally:
        await recorder.stop(timeout=5)


async def test_the_summary_says_stored_only_once_the_journal_is_replayed(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    pending = Pending(journal, max_ids=100)

    async def stored(r: TransitionRecord) -> bool:
        return await pending.wait(r.episode_id, [r.id], timeout=0, hurry=lambda: None)

    journaled = one_call_records(1000)
    for i in range(0, 1000, 100):
        journal.append(journaled[i : i + 100])
        pending.journaled(journaled[i : i + 100])
    queued = one_call_records(300, seed=2)  # in memory, past the bound: kept one by one
    pending.track(queued)
    assert pending.tracked <= 100 + len(queued)
    assert not any([await stored(r) for r in journaled + queued])
    pending.stored(queued)
    assert all([await stored(r) for r in queued])  # (a false positive: ~1 in 10**7 here)

    pending.stored(journaled)  # replayed, the segments not deleted yet: still "maybe"
    assert not any([await stored(r) for r in journaled[100:]])
    for segment in journal.segments():
        journal.remove(segment, 100)
    assert all([await stored(r) for r in journaled])
    assert await pending.wait(journaled[-1].episode_id, None, timeout=0, hurry=lambda: None)


async def test_many_small_segments_replay_in_few_transactions(
    database_url: str, tmp_path: Path
) -> None:
    """Found by the chaos run of round four: after an outage under load, every batch the writers
    journal is a segment of its own (a few records at 700 calls/s), and the replay committed one
    transaction per segment: about 230 transitions/s on two cores against 700/s arriving, so the
    proxy never left the journal while the traffic lasted (and the chaos table's pg-disk-full lost
    everything acknowledged, its 120 s of catch-up not enough). Consecutive segments now replay
    together, in chunks of up to REPLAY_CHUNK records."""
    journal = Journal(tmp_path)
    records = one_call_records(600)
    for i in range(0, len(records), 2):
        journal.append(records[i : i + 2])  # 300 segments of 2, as the writers journal them
    url = database.libpq_url(database_url)

    def commits() -> int:
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
        assert row is not None
        return int(row[0])

    engine, sessionmaker = database.create_async_sessions(database_url)
    recorder = Recorder(
        sessionmaker, journal, batch_size=500, queue_max_bytes=2**30, retry_s=0.1, gamma=None
    )
    before = commits()
    recorder.start()
    try:
        await settle(lambda: journal.pending == 0, timeout=60)
    finally:
        await recorder.stop(timeout=5)
        await engine.dispose()
    used = commits() - before - 1  # (the reading of `before` commits too)
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM transition").fetchone()
    assert row is not None and row[0] == len(records)
    assert not journal.segments()
    assert used <= 10, f"{used} transactions to replay 300 segments"
