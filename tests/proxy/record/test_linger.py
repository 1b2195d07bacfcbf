"""The writer at low load (proxy/record/recorder.py): records that arrive apart share one write,
unless someone waits for them. Real Postgres; each row's `xmin` names the transaction that wrote
it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text

from core import database
from core.database import AsyncSessions
from core.record import TransitionRecord
from fakes.traffic import episode_records
from proxy.record.journal import Journal
from proxy.record.recorder import Recorder


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[AsyncSessions]:
    engine, sessionmaker = database.create_async_sessions(database_url)
    yield sessionmaker
    await engine.dispose()


def recorder_for(
    sessions: AsyncSessions, tmp_path: Path, *, linger_s: float, batch_size: int = 500
) -> Recorder:
    recorder = Recorder(
        sessions,
        Journal(tmp_path),
        batch_size=batch_size,
        linger_s=linger_s,
        queue_max_bytes=2**30,
        retry_s=1.0,
        gamma=None,
    )
    recorder.start()
    return recorder


async def transactions(sessions: AsyncSessions, records: list[TransitionRecord]) -> list[int]:
    """How many rows of these records each writing transaction stored (none: not stored)."""
    async with sessions() as session:
        rows = await session.execute(
            text(
                "SELECT count(*) FROM transition WHERE id = ANY(CAST(:ids AS uuid[])) "
                "GROUP BY xmin::text::bigint ORDER BY 1"
            ),
            {"ids": [r.id for r in records]},
        )
        return [n for (n,) in rows]


def calls(n: int, seed: int) -> list[TransitionRecord]:
    return episode_records(random.Random(seed), turns=n)


async def test_records_that_arrive_apart_share_one_write(
    sessions: AsyncSessions, tmp_path: Path
) -> None:
    recorder = recorder_for(sessions, tmp_path, linger_s=1.0)
    records = calls(3, seed=1)
    for r in records:  # one call's record at a time, as from one client
        recorder.submit([r])
        await asyncio.sleep(0.05)
    assert await transactions(sessions, records) == []  # still lingering
    for _ in range(200):  # until the linger has run out and the write is done
        if written := await transactions(sessions, records):
            break
        await asyncio.sleep(0.05)
    assert written == [3]  # one transaction wrote all three
    await recorder.stop()


async def test_without_linger_each_arrival_is_its_own_write(
    sessions: AsyncSessions, tmp_path: Path
) -> None:
    recorder = recorder_for(sessions, tmp_path, linger_s=0.0)
    records = calls(3, seed=2)
    for r in records:
        recorder.submit([r])
        assert await recorder.wait_stored(r.episode_id, [r.id], timeout=10)
    assert await transactions(sessions, records) == [1, 1, 1]
    await recorder.stop()


@pytest.mark.parametrize("waiter", ["episode", "transition"])
async def test_a_reward_or_episode_read_does_not_wait_out_the_linger(
    sessions: AsyncSessions, tmp_path: Path, waiter: str
) -> None:
    recorder = recorder_for(sessions, tmp_path, linger_s=30.0)
    records = calls(2, seed=3)
    recorder.submit(records)
    ids = [records[-1].id] if waiter == "transition" else None
    assert await recorder.wait_stored(records[0].episode_id, ids, timeout=5)
    assert await transactions(sessions, records) == [2]
    await recorder.stop()


async def test_a_transition_of_another_episode_is_waited_for_too(
    sessions: AsyncSessions, tmp_path: Path
) -> None:
    """A step reward naming a transition (of another episode, by mistake) waits for it, so the
    reward route can tell "not this episode's" from "not stored yet"."""
    recorder = recorder_for(sessions, tmp_path, linger_s=30.0)
    mine, other = calls(1, seed=4), calls(1, seed=5)
    recorder.submit(mine + other)
    assert await recorder.wait_stored(mine[0].episode_id, [other[0].id], timeout=5)
    assert await transactions(sessions, other) == [1]
    await recorder.stop()


async def test_a_full_batch_is_written_at_once(sessions: AsyncSessions, tmp_path: Path) -> None:
    recorder = recorder_for(sessions, tmp_path, linger_s=30.0, batch_size=4)
    records = calls(4, seed=6)
    recorder.submit(records[:2])
    await asyncio.sleep(0.1)  # (no event says "nothing happened": a moment to let it not happen)
    assert await transactions(sessions, records) == []
    recorder.submit(records[2:])
    for _ in range(100):
        if await transactions(sessions, records):
            break
        await asyncio.sleep(0.05)
    assert await transactions(sessions, records) == [4]
    await recorder.stop()


async def test_durable_mode_and_shutdown_write_at_once(
    sessions: AsyncSessions, tmp_path: Path
) -> None:
    recorder = recorder_for(sessions, tmp_path, linger_s=30.0)
    durable = calls(1, seed=7)
    [safe] = recorder.watch([durable[0].id])  # a durable-mode answer waits for this
    recorder.submit(durable)
    await asyncio.wait_for(safe, 5)
    assert await transactions(sessions, durable) == [1]

    last = calls(2, seed=8)
    recorder.submit(last)
    await recorder.stop(timeout=5)
    assert await transactions(sessions, last) == [2]
    assert recorder.journal.pending == 0
