"""The logged window a candidate is estimated on (trainer/data/logged.py `window`), on
Postgres: the newest rewarded episodes of the current version, none older than `max_age_s`."""

from __future__ import annotations

import random
import time

from sqlalchemy import text

from core import database
from core.database import Sessions
from fakes.traffic import episode_records
from proxy.record.store.transitions import insert_transitions
from trainer.data import logged


async def record(database_url: str, ages_s: list[float]) -> list[str]:
    """One rewarded one-call episode of `policy`'s current version (0) per age."""
    engine, sessionmaker = database.create_async_sessions(database_url)
    episodes = []
    try:
        for n, age in enumerate(ages_s):
            [r] = episode_records(random.Random(n), turns=1)
            r.lineage, r.requested_at = "policy", time.time() - age
            async with sessionmaker.begin() as session:
                await insert_transitions([r], session=session, gamma=None)
                await session.execute(
                    text("UPDATE episode SET final_reward = 1 WHERE id = :e"), {"e": r.episode_id}
                )
            episodes.append(r.episode_id)
    finally:
        await engine.dispose()
    return episodes


def window(sessions: Sessions, max_age_s: float) -> set[str]:
    with sessions.begin() as session:
        calls = logged.window(
            session=session,
            lineage="policy",
            version=0,
            tenants=[],
            episodes=10,
            max_age_s=max_age_s,
        )
    return {c.episode_id for c in calls}


async def test_episodes_older_than_the_bound_are_not_estimated_on(
    database_url: str, sessions: Sessions
) -> None:
    fresh, hour_old, day_old = await record(database_url, [5.0, 3600.0, 86400.0])
    assert window(sessions, max_age_s=0) == {fresh, hour_old, day_old}  # 0: any age
    assert window(sessions, max_age_s=7200) == {fresh, hour_old}
    assert window(sessions, max_age_s=600) == {fresh}
