"""The writer's SQL on real Postgres: idempotent batches (journal replays repeat rows)."""

from __future__ import annotations

import random

from sqlalchemy import text

from bench.recording_rate import episode_records
from proxy import database, store


async def test_writing_the_same_batch_twice_stores_it_once(database_url: str) -> None:
    engine = database.create_engine(database_url)
    sessionmaker = database.create_sessionmaker(engine)
    records = episode_records(random.Random(0), turns=3)
    for _ in range(2):  # a replay after a write whose commit was not acknowledged
        async with sessionmaker.begin() as session:
            await store.insert_transitions(records, session=session, gamma=None)
    async with sessionmaker() as session:
        transitions = (await session.execute(text("SELECT count(*) FROM transition"))).scalar()
        messages = (await session.execute(text("SELECT count(*) FROM message"))).scalar()
        [t] = [
            t
            for t in (
                await store.get_episode(records[0]["episode_id"], session=session, tokens=True)
            )["transitions"]  # type: ignore[index]
            if t["id"] == records[-1]["id"]
        ]
    await engine.dispose()
    assert transitions == 3
    assert messages == 5  # system, 3 users, and the (identical) assistant reply: each once
    assert t["prompt_token_ids"] == records[-1]["prompt_token_ids"]
    assert t["params"] == records[-1]["params"] and t["messages"] == records[-1]["messages"]
