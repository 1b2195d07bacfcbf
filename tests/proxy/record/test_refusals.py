"""Postgres refusing for a reason that is not the row's (issue 31, item 4): a failover to a
read-only standby, a table not migrated yet. The rows wait in the journal and reach Postgres once
it takes them again; only data errors (SQLSTATE classes 22 and 23) go to `rejected/`, and
`rejected/` is tried again at start-up.

Everything is real: the proxy, its writer, its journal, a fresh Postgres database per test (made
read-only with `ALTER DATABASE ... SET default_transaction_read_only`, or its table renamed).
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest
from sqlalchemy import exc as sa_exc

from core.database import PostgresRefused, is_outage
from fakes.traffic import episode_records
from tests.conftest import RunningProxy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def wait_for(condition: Callable[[], Any], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def execute(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for sql in statements:
            conn.execute(sql)


# Every session the proxy holds on this database starts again (with the new default).
RECONNECT = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
)
READ_ONLY = (
    "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_read_only = on', "
    "current_database()); END $$",
    RECONNECT,
)
WRITABLE = (
    "SET default_transaction_read_only = off",  # this session's own, to say so
    "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I RESET default_transaction_read_only', "
    "current_database()); END $$",
    RECONNECT,
)
TABLE_AWAY = ("ALTER TABLE transition RENAME TO transition_away",)
TABLE_BACK = ("ALTER TABLE transition_away RENAME TO transition",)


@pytest.mark.parametrize(
    ("fault", "repair"),
    [(READ_ONLY, WRITABLE), (TABLE_AWAY, TABLE_BACK)],
    ids=["read-only standby (25006)", "table not migrated (42P01)"],
)
def test_a_refusal_that_is_not_the_rows_fault_waits_in_the_journal(
    make_proxy: Any, fault: tuple[str, ...], repair: tuple[str, ...]
) -> None:
    proxy: RunningProxy = make_proxy(journal_retry_s=0.2)
    rejected = proxy.settings.journal_dir / "rejected"
    served: list[str] = []
    with proxy.client(**{"X-Episode-Id": "refused"}) as c:

        def call() -> None:
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            served.extend(r.headers["x-transition-id"].split(","))

        call()
        proxy.wait_rows("SELECT 1 FROM transition", 1)
        execute(proxy.database_url, *fault)
        for _ in range(5):
            call()
        # The writer journals them (and keeps trying) instead of setting them aside.
        wait_for(lambda: proxy.services.recorder.journal.pending >= 5)
        assert health(proxy)["database"] != "up"
        assert not list(rejected.iterdir())
        reward = c.post("/v1/rewards", json={"episode_id": "refused", "reward": 1.0})
        assert reward.status_code == 202, reward.text  # journaled with them
        execute(proxy.database_url, *repair)
        call()

    rows = proxy.wait_rows(
        "SELECT id::text FROM transition WHERE episode_id = 'refused'", len(served), timeout=30
    )
    assert sorted(r[0] for r in rows) == sorted(served)
    wait_for(lambda: health(proxy)["database"] == "up")
    assert not list(rejected.iterdir())
    assert proxy.query("SELECT final_reward FROM episode WHERE id = 'refused'") == [(1.0,)]


def health(proxy: RunningProxy) -> dict[str, Any]:
    return httpx.get(proxy.url + "/healthz").json()  # type: ignore[no-any-return]


def test_rejected_rows_are_tried_again_at_start_up(make_proxy: Any, tmp_path: Path) -> None:
    """A row (or a reward) set aside for a missing table or a read-only standby is stored after a
    restart; one that Postgres (or our own encoding) refuses again stays in rejected/, with the
    new error."""
    home = tmp_path / "home"
    rejected = home / "journal" / "rejected"
    rejected.mkdir(parents=True)
    good, bad = episode_records(random.Random(7), turns=2)
    bad.requested_at = 1e15  # year 31 million: no timestamptz holds it
    old_error = "UndefinedTable('relation \"transition\" does not exist')"
    for record in (good, bad):
        kept = {"error": old_error, "record": record}
        (rejected / f"{record.id}.json").write_bytes(orjson.dumps(kept))

    reward = {"episode_id": good.episode_id, "reward": 2.0, "idempotency_key": "k"}
    post = {"error": "ReadOnlySqlTransaction()", "post": {"posted_at": 0, "rewards": [reward]}}
    (rejected / "rewards-1.json").write_bytes(orjson.dumps(post))

    proxy: RunningProxy = make_proxy(home=home, journal_retry_s=0.2)
    rows = proxy.wait_rows("SELECT id::text FROM transition WHERE id = %s", 1, good.id)
    assert rows == [(good.id,)]
    found = proxy.wait_rows("SELECT value FROM reward WHERE idempotency_key = 'k'", 1)
    assert found == [(2.0,)]
    wait_for(lambda: (rejected / f"{bad.id}.json").exists())
    assert [p.name for p in rejected.iterdir()] == [f"{bad.id}.json"]
    error = orjson.loads((rejected / f"{bad.id}.json").read_bytes())["error"]
    assert "UndefinedTable" not in error  # the new refusal, not the old one
    assert not proxy.query("SELECT 1 FROM transition WHERE id = %s", bad.id)


def test_a_row_past_a_postgres_limit_is_set_aside_and_its_neighbours_stored(
    make_proxy: Any,
) -> None:
    """SQLSTATE 54000 (a value too large for an index row) comes as psycopg's OperationalError,
    as a lost connection does: it was taken for an outage, and the row's whole batch went round
    the journal for ever, the writer "down" while Postgres was up."""
    proxy: RunningProxy = make_proxy(journal_retry_s=0.2, writer_linger_s=0.2)
    rejected = proxy.settings.journal_dir / "rejected"
    execute(proxy.database_url, "CREATE INDEX refusals_model ON transition (model_requested)")
    too_long = secrets.token_hex(3000)  # 6,000 incompressible bytes: past a btree row's 2,704
    served: list[str] = []
    with proxy.client(**{"X-Episode-Id": "limit"}) as c:
        for model in ("demo", too_long, "demo"):  # one batch (the writer lingers 200 ms)
            r = c.post("/v1/chat/completions", json={**CHAT, "model": model})
            served.append(r.headers["x-transition-id"])
    bad = served[1]
    wait_for(lambda: (rejected / f"{bad}.json").exists())
    error = orjson.loads((rejected / f"{bad}.json").read_bytes())["error"]
    assert "54000" in error, error
    rows = proxy.wait_rows("SELECT id::text FROM transition WHERE episode_id = 'limit'", 2)
    assert sorted(r[0] for r in rows) == sorted([served[0], served[2]])
    wait_for(lambda: health(proxy)["database"] == "up")
    assert proxy.services.recorder.journal.pending == 0


def test_errors_are_classified_by_sqlstate() -> None:
    def refused(error: psycopg.Error) -> sa_exc.DBAPIError:
        return sa_exc.DBAPIError("INSERT ...", None, error)  # as SQLAlchemy wraps it

    assert is_outage(refused(psycopg.errors.ReadOnlySqlTransaction()))
    assert is_outage(psycopg.errors.InsufficientPrivilege())  # COPY's errors come unwrapped
    assert is_outage(refused(psycopg.errors.UndefinedTable()))
    assert is_outage(PostgresRefused("read-only"))
    # A pool with no connection free for pool_timeout (Postgres hanging): a 503, not a 500.
    assert is_outage(sa_exc.TimeoutError("QueuePool limit of size 10 overflow 10 reached"))
    assert not is_outage(refused(psycopg.errors.NumericValueOutOfRange()))  # 22
    assert not is_outage(psycopg.errors.UniqueViolation())  # 23
    assert not is_outage(ValueError("year 31688738 is out of range"))  # our own encoding
    # 54: psycopg files it under OperationalError, as it does a lost connection; the SQLSTATE wins.
    assert not is_outage(refused(psycopg.errors.ProgramLimitExceeded()))
    assert not is_outage(psycopg.errors.ProgramLimitExceeded())
    assert is_outage(psycopg.OperationalError("server closed the connection unexpectedly"))
