"""The writer's SQL on real Postgres: idempotent batches (journal replays repeat rows)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import text

from core import codecs, database
from core.tables import UNCOMPRESSED
from fakes.traffic import episode_records
from proxy.record.journal import Journal
from proxy.record.recorder import Recorder
from proxy.record.store.episodes import EpisodeRows, get_episode
from proxy.record.store.transitions import insert_transitions


def stored(rows: EpisodeRows | None) -> dict[str, dict[str, Any]]:
    """An episode's transitions as stored, by id: messages, token ids, logprobs, params."""
    assert rows is not None
    return {
        str(t.id): {
            "messages": [rows.messages.get(d) for d in t.message_digests],
            "prompt_token_ids": codecs.unpack(rows.prompt_ids(t), "i"),
            "completion_token_ids": codecs.unpack(t.completion_token_ids, "i"),
            "logprobs": codecs.unpack(t.logprobs, "f"),
            "params": t.params,
        }
        for t in rows.transitions
    }


async def test_writing_the_same_batch_twice_stores_it_once(database_url: str) -> None:
    engine, sessionmaker = database.create_async_sessions(database_url)
    records = episode_records(random.Random(0), turns=3)
    for _ in range(2):  # a replay after a write whose commit was not acknowledged
        async with sessionmaker.begin() as session:
            await insert_transitions(records, session=session, gamma=None)
    async with sessionmaker() as session:
        transitions = (await session.execute(text("SELECT count(*) FROM transition"))).scalar()
        messages = (await session.execute(text("SELECT count(*) FROM message"))).scalar()
        t = stored(await get_episode(records[0].episode_id, session=session))[records[-1].id]
    await engine.dispose()
    assert transitions == 3
    assert messages == 5  # system, 3 users, and the (identical) assistant reply: each once
    assert t["prompt_token_ids"] == records[-1].prompt_token_ids
    assert t["params"] == records[-1].params and t["messages"] == records[-1].messages


async def count(sessionmaker: Any, table: str) -> int:
    async with sessionmaker() as session:
        return int((await session.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())


async def test_a_partly_stored_batch_stores_only_the_new_rows(database_url: str) -> None:
    """COPY straight into the table meets an existing row: the batch goes the ON CONFLICT way."""
    engine, sessionmaker = database.create_async_sessions(database_url)
    records = episode_records(random.Random(1), turns=4)
    for batch in (records[:2], records):  # a journal replay overlapping a committed batch
        async with sessionmaker.begin() as session:
            await insert_transitions(batch, session=session, gamma=None)
    async with sessionmaker() as session:
        episode = stored(await get_episode(records[0].episode_id, session=session))
    transitions = await count(sessionmaker, "transition")
    await engine.dispose()
    assert transitions == 4
    for r in records:
        assert episode[r.id]["messages"] == r.messages
        assert episode[r.id]["completion_token_ids"] == r.completion_token_ids
        assert episode[r.id]["logprobs"] == pytest.approx(r.logprobs, rel=1e-6)


async def test_messages_known_to_be_stored_are_not_sent_again(database_url: str) -> None:
    engine, sessionmaker = database.create_async_sessions(database_url)
    first, second = episode_records(random.Random(2), turns=2)
    async with sessionmaker.begin() as session:
        sent = await insert_transitions([first], session=session, gamma=None)
    assert len(sent) == 3  # system, user, the prompt's first block of token ids
    async with sessionmaker.begin() as session:
        sent_again = await insert_transitions(
            [second], session=session, gamma=None, stored=set(sent)
        )
    async with sessionmaker() as session:
        episode = stored(await get_episode(first.episode_id, session=session))
    messages = await count(sessionmaker, "message")
    await engine.dispose()
    # The assistant's reply and the next user message; the longer prompt's one whole block is
    # the same as the first's.
    assert len(sent_again) == 2
    assert messages == 4
    assert [t["messages"] for t in episode.values()] == [first.messages, second.messages]


async def test_a_call_without_prompt_messages_stores_an_empty_list(database_url: str) -> None:
    engine, sessionmaker = database.create_async_sessions(database_url)
    [record] = episode_records(random.Random(3), turns=1)
    record.messages = []
    async with sessionmaker.begin() as session:
        await insert_transitions([record], session=session, gamma=None)
    async with sessionmaker() as session:
        episode = stored(await get_episode(record.episode_id, session=session))
    await engine.dispose()
    assert episode[record.id]["messages"] == []


async def test_packed_columns_are_stored_uncompressed(database_url: str) -> None:
    engine, _ = database.create_async_sessions(database_url)
    async with engine.connect() as conn:
        storage = dict(
            (
                await conn.execute(
                    text(
                        "SELECT attname, attstorage FROM pg_attribute "
                        "WHERE attrelid = 'transition'::regclass AND attnum > 0"
                    )
                )
            ).all()
        )
    await engine.dispose()
    assert {c: storage[c] for c in UNCOMPRESSED} == {c: "e" for c in UNCOMPRESSED}


async def test_interleaved_episodes_through_two_writers_lose_nothing(
    database_url: str, tmp_path: Path
) -> None:
    """Small batches, episodes interleaved as from concurrent agents: histories repeat across
    batches (the known-messages path) and both writers have batches in flight."""
    rng = random.Random(4)
    episodes = [episode_records(rng, turns=5) for _ in range(8)]
    records = [r for turn in zip(*episodes, strict=True) for r in turn]
    engine, sessionmaker = database.create_async_sessions(database_url)
    recorder = Recorder(
        sessionmaker,
        Journal(tmp_path),
        batch_size=3,
        queue_max_bytes=2**30,
        retry_s=1.0,
        gamma=None,
    )
    recorder.start()
    for i in range(0, len(records), 4):
        recorder.submit(records[i : i + 4])
        await asyncio.sleep(0)
    for episode in episodes:
        assert await recorder.wait_stored(episode[0].episode_id, timeout=60)
    await recorder.stop()
    transitions, messages = (
        await count(sessionmaker, "transition"),
        await count(sessionmaker, "message"),
    )
    await engine.dispose()
    assert recorder.journal.pending == 0
    assert transitions == len(records)
    assert messages == len({codecs.message_digest(m) for r in records for m in r.messages})


def test_memoised_message_digests_equal_the_plain_ones() -> None:
    long_text = "x" * (codecs.MEMO_MAX_CHARS + 1)
    for body in [
        {"role": "user", "content": "hi"},
        {"content": "hi", "role": "user"},
        {"role": "user", "content": long_text},  # too long to memoise
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"prompt": "2+3="},
    ]:
        assert codecs.message_digest(body) == codecs._digest(body)
        digest_again = codecs.message_digest(orjson.loads(orjson.dumps(body)))
        assert codecs.message_digest(body) == digest_again
