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


async def record(
    database_url: str, ages_s: list[float], versions: list[int] | None = None
) -> list[str]:
    """One rewarded one-call episode of `policy` per age, served by the current version (0), or
    by each of `versions` and held out (`ope_holdout`, as the proxy sets it aside)."""
    engine, sessionmaker = database.create_async_sessions(database_url)
    episodes = []
    try:
        for n, age in enumerate(ages_s):
            [r] = episode_records(random.Random(n), turns=1)
            r.lineage, r.requested_at = "policy", time.time() - age
            if versions:
                r.policy_version = versions[n]
            async with sessionmaker.begin() as session:
                await insert_transitions([r], session=session, gamma=None)
                await session.execute(
                    text("UPDATE episode SET final_reward = 1 WHERE id = :e"), {"e": r.episode_id}
                )
                if versions:
                    await session.execute(
                        text("UPDATE transition SET skip_reason = 'ope_holdout' "
                             "WHERE episode_id = :e"),
                        {"e": r.episode_id},
                    )  # fmt: skip
            episodes.append(r.episode_id)
    finally:
        await engine.dispose()
    return episodes


def window(
    sessions: Sessions, max_age_s: float = 0.0, version: int = 0, versions: int = 0
) -> set[str]:
    with sessions.begin() as session:
        calls = logged.window(
            session=session,
            lineage="policy",
            version=version,
            tenants=[],
            episodes=10,
            max_age_s=max_age_s,
            versions=versions,
        )
    return {c.episode_id for c in calls}


async def test_episodes_older_than_the_bound_are_not_estimated_on(
    database_url: str, sessions: Sessions
) -> None:
    fresh, hour_old, day_old = await record(database_url, [5.0, 3600.0, 86400.0])
    assert window(sessions, max_age_s=0) == {fresh, hour_old, day_old}  # 0: any age
    assert window(sessions, max_age_s=7200) == {fresh, hour_old}
    assert window(sessions, max_age_s=600) == {fresh}


async def test_episodes_of_versions_older_than_the_bound_are_not_estimated_on(
    database_url: str, sessions: Sessions
) -> None:
    """FLYWHEEL_OPE_MAX_VERSIONS: held-out episodes of the lineage's versions 1, 3, 4 and 6 (a
    number between them another lineage's), v6 current; the bound counts the lineage's own."""
    with sessions.begin() as session:
        for version, lineage in [(1, "policy"), (3, "policy"), (4, "policy"), (5, "other"),
                                 (6, "policy")]:  # fmt: skip
            session.execute(
                text("INSERT INTO adapter_version (version, lineage, name, path, base_model) "
                     "VALUES (:v, :l, :n, '/x', 'm')"),
                {"v": version, "l": lineage, "n": f"{lineage}-v{version}"},
            )  # fmt: skip
    v1, v3, v4, v6 = await record(database_url, [40.0, 30.0, 20.0, 10.0], [1, 3, 4, 6])
    assert window(sessions, version=6) == {v1, v3, v4, v6}  # 0: any version
    assert window(sessions, version=6, versions=3) == {v3, v4, v6}
    assert window(sessions, version=6, versions=2) == {v4, v6}
    assert window(sessions, version=6, versions=1) == {v6}
