"""Partitions and retention on real Postgres (issue 15, part 2): days made ahead and filled from
the default partition, old days dropped or archived with what only they used, untrained days
kept, and the proxy recording through all of it without losing a call."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pyarrow.parquet as pq
import pytest

from core import database, partitions, retention
from core.record import TransitionRecord
from proxy.record.store.transitions import insert_transitions
from tests.conftest import RunningProxy

NOW = datetime.now(UTC)
TODAY = NOW.date()
SYSTEM = {"role": "system", "content": "You are a calculator."}


def at(days_ago: int) -> datetime:
    return NOW - timedelta(days=days_ago)


def record(
    episode: str,
    days_ago: int,
    *messages: dict[str, Any],
    prompt: list[int] | None = None,
    **fields: Any,
) -> TransitionRecord:
    return TransitionRecord(
        id=str(uuid.uuid4()),
        episode_id=episode,
        request_id=str(uuid.uuid4()),
        choice_index=0,
        requested_at=at(days_ago).timestamp(),
        route="chat",
        status="ok",
        http_status=200,
        messages=list(messages),
        latency_ms=1.0,
        lineage="policy",
        prompt_token_ids=prompt or [1, 2, 3],
        completion_token_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        text="7",
        **fields,
    )


def seed(database_url: str, batches: list[tuple[int, list[TransitionRecord]]]) -> None:
    """Each batch written as a writer on that day would have (its `today`)."""

    async def write() -> None:
        engine, sessionmaker = database.create_async_sessions(database_url)
        for days_ago, records in batches:
            async with sessionmaker.begin() as session:
                await insert_transitions(
                    records, session=session, gamma=None, today=at(days_ago).date()
                )
        await engine.dispose()

    asyncio.run(write())


def query(database_url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute(sql, params).fetchall()


def dangling_digests(database_url: str) -> int:
    """Message or token block digests a stored transition names that `message` or
    `token_block` lacks: must always be 0."""
    return query(
        database_url,
        "SELECT (SELECT count(*) FROM transition t, unnest(t.message_digests) d "
        "WHERE NOT EXISTS (SELECT 1 FROM message m WHERE m.digest = d)) + "
        "(SELECT count(*) FROM transition t, unnest(t.prompt_blocks) d "
        "WHERE NOT EXISTS (SELECT 1 FROM token_block b WHERE b.digest = d))",
    )[0][0]


# Token ids: a block that the system prompt's ids make, used on day 20 and today, and one that
# only day 20's prompts have (core/codecs.py BLOCK_TOKENS).
SHARED_BLOCK = list(range(1000, 1256))
BLOCK20 = [*SHARED_BLOCK, *range(2000, 2256), 7]


@pytest.fixture
def engine(database_url: str) -> Any:
    engine, _ = database.create_sessions(database_url)
    yield engine
    engine.dispose()


def test_days_are_made_ahead_and_the_default_partitions_rows_moved_into_theirs(
    database_url: str, engine: Any
) -> None:
    seed(database_url, [(40, [record("old", 40)]), (0, [record("now", 0), record("now", -2)])])
    where = "SELECT tableoid::regclass::text FROM transition ORDER BY requested_at"
    assert query(database_url, where) == [(partitions.DEFAULT,)] * 3  # no day made yet

    made = partitions.ensure(engine, today=TODAY, ahead=3)

    days = [TODAY - timedelta(days=40)] + [TODAY + timedelta(days=i) for i in range(4)]
    assert sorted(made) == sorted(partitions.name_of(d) for d in days)
    assert [r[0] for r in query(database_url, where)] == [
        partitions.name_of(at(40).date()),
        partitions.name_of(TODAY),
        partitions.name_of(at(-2).date()),
    ]
    assert query(database_url, f"SELECT count(*) FROM {partitions.DEFAULT}") == [(0,)]
    assert partitions.ensure(engine, today=TODAY, ahead=3) == []  # nothing left to make
    # A day's partition keeps the packed columns uncompressed, as the parent says.
    storage = query(
        database_url,
        "SELECT attname, attstorage FROM pg_attribute WHERE attrelid = %s::regclass "
        "AND attname = ANY(%s)",
        partitions.name_of(TODAY),
        ["prompt_token_ids", "completion_token_ids", "logprobs"],
    )
    assert {s for _, s in storage} == {"e"}


def scenario(database_url: str, engine: Any) -> dict[str, Any]:
    """Days 20 (trained), 9 (credited, not trained yet), 8 (never rewarded) ago, and today.

    Episode `long` spans day 20 and today; `gone` lives on day 20 only and has a final and a
    step reward; the system prompt is used on day 20 and today; `only20` and `only8` are used on
    those days alone."""
    only20 = {"role": "user", "content": "only on day 20"}
    only8 = {"role": "user", "content": "only on day 8"}
    day20 = [
        record("long", 20, SYSTEM, only20, prompt=BLOCK20),
        record("gone", 20, SYSTEM, only20, prompt=BLOCK20),
    ]
    day9 = [record("waiting", 9, SYSTEM)]
    day8 = [record("unrewarded", 8, only8)]
    today = [
        record(
            "long", 0, SYSTEM, {"role": "user", "content": "today"}, prompt=[*SHARED_BLOCK, 8, 9]
        )
    ]
    seed(database_url, [(20, day20), (9, day9), (8, day8), (0, today)])
    partitions.ensure(engine, today=TODAY, ahead=1)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            'UPDATE transition SET credited_at = now(), "return" = 1, trained_at = now() '
            "WHERE episode_id IN ('long', 'gone')"
        )
        conn.execute("UPDATE transition SET credited_at = now() WHERE episode_id = 'waiting'")
        conn.execute(
            "INSERT INTO reward (episode_id, transition_id, value) VALUES ('gone', NULL, 1), "
            "('gone', %s, 0.5), ('long', %s, 0.5)",
            (day20[1].id, day20[0].id),
        )
        conn.execute(  # an episode begins with its first call
            "UPDATE episode e SET created_at = "
            "(SELECT min(requested_at) FROM transition t WHERE t.episode_id = e.id)"
        )
        # An episode that only ever got a reward (no call: no last_call_at), 20 days ago.
        conn.execute("INSERT INTO episode (id, created_at) VALUES ('reward-only', %s)", (at(20),))
        conn.execute("INSERT INTO reward (episode_id, value) VALUES ('reward-only', 1)")
    return {"day20": day20, "day9": day9, "day8": day8, "today": today}


def test_retention_drops_old_days_and_only_what_they_alone_used(
    database_url: str, engine: Any
) -> None:
    rows = scenario(database_url, engine)
    before = query(database_url, "SELECT count(*) FROM message")[0][0]
    # The writer keeps each episode's newest call (what lets retention look only in old days).
    assert query(database_url, "SELECT last_call_at FROM episode WHERE id = 'long'") == [
        (datetime.fromtimestamp(rows["today"][0].requested_at, UTC),)
    ]

    done = retention.retain(engine, database_url, days=5)

    actions = {d.partition.name: d.action for d in done.decisions}
    assert actions == {
        partitions.name_of(at(20).date()): "drop",
        partitions.name_of(at(9).date()): "keep",  # a trainer has not had it yet
        partitions.name_of(at(8).date()): "drop",
    }
    kept = {r[0] for r in query(database_url, "SELECT episode_id FROM transition")}
    assert kept == {"waiting", "long"}
    # `gone`, `unrewarded` and `reward-only` had nothing left: they go with their rewards;
    # `long` stays, less the step reward of its dropped call.
    assert (done.episodes, done.rewards) == (3, 4)
    assert {r[0] for r in query(database_url, "SELECT id FROM episode")} == {"long", "waiting"}
    assert query(database_url, "SELECT count(*) FROM reward") == [(0,)]
    # Day 20's own message went; day 8's stays while day 9 is kept (messages last used within
    # a day of the oldest day kept stay); the system prompt is used today.
    assert (
        done.messages == 1
        and before - 1 == query(database_url, "SELECT count(*) FROM message")[0][0]
    )
    # Likewise the token id block only day 20's prompts had; the shared one is used today.
    assert done.blocks == 1 and query(database_url, "SELECT count(*) FROM token_block") == [(1,)]
    assert dangling_digests(database_url) == 0
    assert done.bytes_after["transition"] < done.bytes_before["transition"]
    assert rows["today"][0].id in {
        str(r[0]) for r in query(database_url, "SELECT id FROM transition")
    }

    # Told to, it drops the untrained day too; then day 8's message goes as well.
    again = retention.retain(engine, database_url, days=5, include_untrained=True)
    assert [d.action for d in again.decisions] == ["drop"]
    assert {r[0] for r in query(database_url, "SELECT episode_id FROM transition")} == {"long"}
    assert again.messages == 1 and dangling_digests(database_url) == 0


def test_a_dry_run_changes_nothing(database_url: str, engine: Any) -> None:
    scenario(database_url, engine)
    count = (
        "SELECT (SELECT count(*) FROM transition), (SELECT count(*) FROM message), "
        "(SELECT count(*) FROM episode), (SELECT count(*) FROM reward)"
    )
    before = query(database_url, count)
    done = retention.retain(engine, database_url, days=5, dry_run=True)
    assert [d.action for d in done.decisions] == ["drop", "keep", "drop"]
    assert query(database_url, count) == before


def test_archive_exports_a_day_before_dropping_it(
    database_url: str, engine: Any, tmp_path: Path
) -> None:
    rows = scenario(database_url, engine)
    done = retention.retain(engine, database_url, days=5, archive=tmp_path / "archive")
    archived = {d.partition.name: d.archive for d in done.decisions if d.action == "drop"}
    day20 = archived[partitions.name_of(at(20).date())]
    assert day20 is not None and day20.exists()
    table = pq.read_table(day20).to_pylist()
    assert sorted(r["id"] for r in table) == sorted(r.id for r in rows["day20"])
    assert all(r["completion_token_ids"] == [4, 5] for r in table)
    assert orjson.loads(table[0]["messages"])[0] == SYSTEM  # JSON text in Parquet


def test_bad_arguments_are_refused(database_url: str, engine: Any) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        retention.retain(engine, database_url, days=0)


def test_migration_makes_the_old_table_one_partition_without_copying(
    database_url: str, postgres_url: str
) -> None:
    """Rows recorded before 0011 stay where they are, in `transition_legacy`, readable as
    before and dropped whole once every row in it is old enough."""
    from alembic import command

    from core.database import alembic_config

    config = alembic_config(database_url)
    command.downgrade(config, "0010")
    with psycopg.connect(database_url) as conn:
        conn.execute("INSERT INTO episode (id) VALUES ('before')")
        conn.execute(
            "INSERT INTO transition (id, episode_id, request_id, choice_index, requested_at, "
            "route, status, http_status, message_digests, params, latency_ms) VALUES "
            "(gen_random_uuid(), 'before', gen_random_uuid(), 0, now() - interval '30 days', "
            "'chat', 'ok', 200, '{}', '{}', 1)"
        )
        relfilenode = conn.execute(
            "SELECT relfilenode FROM pg_class WHERE relname = 'transition'"
        ).fetchone()
    migrated_on = datetime.now(UTC).date()  # the legacy range ends with the migration's day
    database.migrate(database_url)
    assert query(
        database_url, "SELECT relfilenode FROM pg_class WHERE relname = %s", partitions.LEGACY
    ) == [relfilenode]
    assert query(database_url, "SELECT episode_id FROM transition") == [("before",)]
    engine, _ = database.create_sessions(database_url)
    try:
        legacy_hi = next(p for p in _partitions(engine) if p.name == partitions.LEGACY).hi
        # (a migration running across midnight UTC may end it with the next day)
        ends = {partitions.start_of(migrated_on + timedelta(days=d)) for d in (1, 2)}
        assert legacy_hi in ends
        # Kept while its newest day is younger than the cutoff, though its rows are old.
        assert retention.retain(engine, database_url, days=1).decisions == []
        later = legacy_hi + timedelta(days=1)
        done = retention.retain(engine, database_url, days=1, now=later)
        assert [(d.partition.name, d.action) for d in done.decisions] == [
            (partitions.LEGACY, "drop")
        ]
        assert query(database_url, "SELECT count(*) FROM transition") == [(0,)]
    finally:
        engine.dispose()


def _partitions(engine: Any) -> list[partitions.Partition]:
    with engine.begin() as conn:
        return partitions.partitions(conn)


def test_the_proxy_records_every_call_while_days_are_made_and_dropped(
    make_proxy: Any, database_url: str, engine: Any
) -> None:
    """Calls through the proxy while another connection makes days and drops old ones, over
    and over (each drop locks the parent table for a moment): every answered call is stored."""
    proxy: RunningProxy = make_proxy(maintenance_s=3600)
    stop = threading.Event()
    rounds = 0

    def churn() -> None:
        nonlocal rounds
        day = 0
        while not stop.is_set():
            day += 1
            seed(database_url, [(30 + day, [record(f"old-{day}", 30 + day, SYSTEM)])])
            partitions.ensure(engine, today=TODAY + timedelta(days=day % 5), ahead=2)
            done = retention.retain(engine, database_url, days=7, include_untrained=True)
            assert all(d.action == "drop" for d in done.decisions), done.decisions
            rounds += 1

    churner = threading.Thread(target=churn)
    churner.start()
    episodes = []
    try:
        with proxy.client() as client:
            # At least 150 calls, and on until the churner has done 3 rounds (a loaded
            # machine runs it slower than the calls).
            deadline = time.monotonic() + 120
            i = 0
            while (i < 150 or rounds < 3) and time.monotonic() < deadline:
                i += 1
                # Every 5th call continues an old episode that retention is dropping meanwhile.
                episode = f"old-{max(1, rounds)}" if i % 5 == 0 else f"live-{i}"
                r = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "demo",
                        "messages": [SYSTEM, {"role": "user", "content": str(i)}],
                        "max_tokens": 3,
                    },
                    headers={"X-Episode-Id": episode},
                )
                assert r.status_code == 200, r.text
                episodes.append(episode)
    finally:
        stop.set()
        churner.join()
    assert rounds >= 3
    recent = "SELECT id FROM transition WHERE requested_at > now() - interval '1 hour'"
    proxy.wait_rows(recent, len(episodes))  # every answered call
    assert {r[0] for r in query(database_url, "SELECT episode_id FROM transition")} >= set(episodes)
    old = "SELECT count(*) FROM transition WHERE requested_at < now() - interval '8 days'"
    assert query(database_url, old) == [(0,)]
    assert dangling_digests(database_url) == 0
    # Every call's episode is there, the continued old ones included.
    assert query(
        database_url,
        "SELECT count(*) FROM transition t WHERE NOT EXISTS "
        "(SELECT 1 FROM episode e WHERE e.id = t.episode_id)",
    ) == [(0,)]
