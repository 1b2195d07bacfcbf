"""Postgres goes away under traffic: serving continues, nothing acknowledged is lost.

Uses its own embedded PostgreSQL (the shared one stays up for the other tests) and stops it with
`pg_ctl stop -m fast`, as an outage or a database restart would.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import RunningProxy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def health(proxy: RunningProxy) -> dict[str, Any]:
    return httpx.get(proxy.url + "/healthz").json()  # type: ignore[no-any-return]


@pytest.mark.slow
def test_postgres_stopped_under_traffic_loses_nothing(own_postgres: Any, make_proxy: Any) -> None:
    url = own_postgres.url
    proxy = make_proxy(database_url=url, journal_retry_s=0.2)
    served: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        with proxy.client(**{"X-Episode-Id": "outage"}) as c:
            while not stop.is_set():
                r = c.post("/v1/chat/completions", json=CHAT)
                if r.status_code == 200:
                    served.extend(r.headers["x-transition-id"].split(","))
                else:
                    failures.append(r.text)

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    for t in threads:
        t.start()
    while len(served) < 20:  # traffic under way
        assert not failures, failures
        time.sleep(0.02)
    own_postgres.stop()  # mid-traffic
    deadline = time.monotonic() + 15
    while health(proxy)["journal_pending"] == 0:  # the writer has met the outage
        assert time.monotonic() < deadline, "nothing journaled while Postgres is down"
        time.sleep(0.05)
    assert health(proxy)["database"] != "up"
    # A reward waits in the journal with the transitions (202), applied when it is replayed.
    r = proxy.client().post("/v1/rewards", json={"episode_id": "outage", "reward": 1.0})
    assert r.status_code == 202 and r.json()["status"] == "journaled", r.text
    stop.set()
    for t in threads:
        t.join()

    # A graceful shutdown while Postgres is still down keeps everything in the journal...
    proxy.stop()
    journal = proxy.settings.journal_dir
    assert list(journal.glob("segment-*.jsonl"))
    own_postgres.start()
    # ...and the next proxy on the same home replays it.
    second = make_proxy(database_url=url, home=proxy.settings.home, journal_retry_s=0.2)
    with second.client(**{"X-Episode-Id": "outage"}) as c:
        after = c.post("/v1/chat/completions", json=CHAT).headers["x-transition-id"]
    served.append(after)

    assert failures == []
    assert len(served) > 20
    rows = second.wait_rows(
        "SELECT id::text FROM transition WHERE episode_id = 'outage'", len(served), timeout=30
    )
    assert sorted(r[0] for r in rows) == sorted(served)
    assert second.wait_rows("SELECT 1 FROM episode WHERE final_reward = 1.0", 1) == [(1,)]
    assert not list(journal.glob("segment-*.jsonl"))
    assert health(second)["database"] == "up"
