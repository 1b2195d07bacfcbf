"""A proxy that starts while Postgres is unreachable (a restart or a reschedule during an outage):
it serves, records to the journal, serves the policy it last knew, and migrates and replays once
Postgres answers (proxy/record/migrator.py, the alias's snapshot in proxy/relay/alias.py).

Each test has its own embedded PostgreSQL, stopped before the proxy starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from core import database, naming, policy
from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def health(proxy: RunningProxy) -> dict[str, Any]:
    return httpx.get(proxy.url + "/healthz").json()  # type: ignore[no-any-return]


def served(proxy: RunningProxy, episode: str, n: int) -> list[str]:
    ids = []
    with proxy.client(**{"X-Episode-Id": episode}) as c:
        for _ in range(n):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            ids.append(r.headers["x-transition-id"])
    return ids


def empty_database(server_url: str, name: str) -> str:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return database.with_database(server_url, name)


@pytest.mark.slow
def test_a_proxy_starts_while_postgres_is_down_and_migrates_once_it_answers(
    own_postgres: Any, make_proxy: Any
) -> None:
    url = empty_database(own_postgres.url, "late")  # never migrated
    own_postgres.stop()

    proxy = make_proxy(database_url=url, journal_retry_s=0.2)
    assert health(proxy)["database"] != "up"
    ids = served(proxy, "started-in-an-outage", 5)
    proxy.wait_until(lambda: health(proxy)["journal_pending"] == 5, "5 journaled", timeout=30)
    # Reads need the schema: a clear 503, not a 500 on a missing table.
    r = proxy.client().get("/v1/episodes/started-in-an-outage")
    assert r.status_code == 503, r.text

    own_postgres.start()
    proxy.wait_until(lambda: health(proxy)["database"] == "up", "migrated, replayed", timeout=30)
    rows = proxy.query("SELECT id::text FROM transition WHERE episode_id = 'started-in-an-outage'")
    assert sorted(r[0] for r in rows) == sorted(ids)
    assert not list(proxy.settings.journal_dir.glob("segment-*.jsonl"))
    r = proxy.client().get("/v1/episodes/started-in-an-outage")
    assert r.status_code == 200 and len(r.json()["transitions"]) == 5, r.text


@pytest.mark.slow
def test_a_proxy_started_in_an_outage_serves_the_policy_it_last_knew(
    own_postgres: Any, make_proxy: Any, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    adapter = tmp_path / "policy-v1"
    adapter.mkdir()
    url = empty_database(own_postgres.url, "known")
    database.migrate(url)
    engine, sessions = database.create_sessions(url)
    with sessions.begin() as session:
        policy.publish(
            session=session,
            lineage=naming.DEFAULT_LINEAGE,
            parent=None,
            version=1,
            path=str(adapter),
            base_model="demo",
            stats={},
            trained_transitions=8,
        )
    engine.dispose()
    first = make_proxy(database_url=url)
    served(first, "before", 1)
    assert fake_vllm.requests[-1]["body"]["model"] == "policy-v1"
    first.stop()

    own_postgres.stop()
    second = make_proxy(database_url=url, home=first.settings.home, journal_retry_s=0.2)
    fake_vllm.requests.clear()
    ids = served(second, "during", 3)
    # Not the base model: the version it knew when it last reached Postgres.
    assert {r["body"]["model"] for r in fake_vllm.requests} == {"policy-v1"}

    own_postgres.start()
    rows = second.wait_rows(
        "SELECT id::text, policy_version FROM transition WHERE episode_id = 'during'",
        len(ids),
        timeout=30,
    )
    assert sorted(rows) == sorted((i, 1) for i in ids)
