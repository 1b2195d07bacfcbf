"""`flywheel export` (issue 15, part 1): recorded transitions out to JSON Lines and Parquet,
loaded back with Hugging Face `datasets`, compared with what the proxy serves for the same
episodes (`GET /v1/episodes/{id}?tokens=true`). Real Postgres, the real proxy on the fake vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import httpx
import psycopg
import pyarrow.parquet
import pytest

from core.database import Sessions
from core.export import ExportFilter, export
from core.export_kinds import columns
from core.tenants import Principal
from proxy.config import ProxySettings
from tests.conftest import RunningProxy
from tests.core.test_tenants import new_key

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
SOLVE = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2 + 3?"}]


def call(proxy: RunningProxy, key: str, episode: str, messages: list[Any], **body: Any) -> str:
    headers = {"Authorization": f"Bearer {key}", "X-Episode-Id": episode, "X-Task-Id": "sum"}
    with proxy.client(**headers, **{"X-Agent-Name": "solver"}) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "policy", "messages": messages, "max_tokens": 5, **body},
        )
        assert r.status_code == 200, r.text
    return r.headers["x-transition-id"]


def reward(proxy: RunningProxy, key: str, episode: str, value: float) -> None:
    with proxy.client(Authorization=f"Bearer {key}") as c:
        r = c.post("/v1/rewards", json={"episode_id": episode, "reward": value})
        assert r.status_code == 200, r.text


@pytest.fixture
def recorded(make_proxy: Any, sessions: Sessions) -> tuple[RunningProxy, str]:
    """Tenant acme: three episodes of one prompt (rewards 1, 0, 0.5), one with tools and a
    second turn, one unrewarded; tenant globex: one episode."""
    proxy = make_proxy(auth="keys", keys_refresh_s=0.1)
    acme, globex = new_key(sessions, "acme"), new_key(sessions, "globex")
    proxy.wait_keys(acme, globex)
    for i, value in enumerate([1.0, 0.0, 0.5]):
        call(proxy, acme, f"e{i}", SOLVE)
        reward(proxy, acme, f"e{i}", value)
    call(proxy, acme, "tools", SOLVE, tools=TOOLS)
    call(proxy, acme, "tools", [*SOLVE, {"role": "assistant", "content": "5"}])
    call(proxy, acme, "open", [{"role": "user", "content": "no reward yet"}])
    call(proxy, globex, "e0", SOLVE)
    proxy.wait_rows("SELECT 1 FROM transition", 7)
    proxy.wait_rows("SELECT 1 FROM transition WHERE credited_at IS NOT NULL", 3)
    return proxy, acme


def episode_view(proxy: RunningProxy, key: str, episode: str) -> dict[str, Any]:
    with proxy.client(Authorization=f"Bearer {key}") as c:
        r = c.get(f"/v1/episodes/{episode}", params={"tokens": "true"})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


def test_transitions_round_trip_through_jsonl_and_parquet_into_datasets(
    recorded: tuple[RunningProxy, str], tmp_path: Path
) -> None:
    proxy, acme = recorded
    where = ExportFilter(principal=Principal("acme", frozenset()))
    jsonl = export(proxy.database_url, tmp_path / "acme.jsonl", where=where, tokens=True)
    parquet = export(proxy.database_url, tmp_path / "acme.parquet", where=where, tokens=True)
    assert jsonl.rows == parquet.rows == 6  # acme's own, not globex's
    from_json = datasets.load_dataset("json", data_files=str(jsonl.path), split="train")
    from_parquet = datasets.Dataset.from_parquet(str(parquet.path))
    assert isinstance(from_parquet, datasets.Dataset)
    assert len(from_json) == len(from_parquet) == 6

    # Every row as the proxy serves its transition, under the tenant's own ids; the token ids
    # and behaviour logprobs identical in both formats.
    served = {
        t["id"]: (e, t)
        for e in (episode_view(proxy, acme, ep) for ep in ["e0", "e1", "e2", "tools", "open"])
        for t in e["transitions"]
    }
    assert set(from_json["id"]) == set(from_parquet["id"]) == set(served)
    for row, prow in zip(from_json, from_parquet, strict=True):
        episode, t = served[row["id"]]
        assert row["episode_id"] == episode["id"] and row["task_id"] == "sum"
        assert row["messages"] == t["messages"] == json.loads(prow["messages"])
        assert row["text"] == t["text"] == prow["text"]
        assert row["policy_version"] == t["policy_version"] == prow["policy_version"]
        assert row["return"] == t["return"] == prow["return"]
        assert row["final_reward"] == episode["final_reward"] == prow["final_reward"]
        for name in ("prompt_token_ids", "completion_token_ids"):
            assert row[name] == t[name] == prow[name]
        assert prow["logprobs"] == pytest.approx(t["logprobs"], abs=0)  # float32 both ways
        assert row["logprobs"] == pytest.approx(t["logprobs"], rel=1e-6)
    # Oldest first.
    assert list(from_json["requested_at"]) == sorted(from_json["requested_at"])


def test_sft_rows_and_preference_pairs_are_trls_conversational_formats(
    recorded: tuple[RunningProxy, str], tmp_path: Path
) -> None:
    proxy, acme = recorded
    where = ExportFilter(principal=Principal("acme", frozenset()))
    sft = export(proxy.database_url, tmp_path / "sft.jsonl", kind="sft", where=where)
    rows = [json.loads(line) for line in sft.path.read_text().splitlines()]
    assert len(rows) == 6
    tooled = next(r for r in rows if r["episode_id"] == "tools" and r["tools"])
    assert tooled["tools"] == TOOLS
    for r in rows:
        *prompt, answer = r["messages"]
        assert prompt and answer["role"] == "assistant" and isinstance(answer["content"], str)

    pairs = export(proxy.database_url, tmp_path / "pairs.parquet", kind="pairs", where=where)
    [pair] = datasets.Dataset.from_parquet(str(pairs.path))  # one prompt rewarded differently
    assert json.loads(pair["prompt"]) == SOLVE
    assert (pair["chosen_return"], pair["rejected_return"]) == (1.0, 0.0)
    e0 = episode_view(proxy, acme, "e0")["transitions"][0]
    assert pair["chosen_id"] == e0["id"]
    assert json.loads(pair["chosen"]) == [{"role": "assistant", "content": e0["text"]}]


@pytest.mark.slow
def test_filters_and_the_command_line(recorded: tuple[RunningProxy, str], tmp_path: Path) -> None:
    proxy, _ = recorded

    def ids(**filters: Any) -> list[str]:
        done = export(proxy.database_url, tmp_path / "f.jsonl", where=ExportFilter(**filters))
        return [json.loads(line)["episode_id"] for line in done.path.read_text().splitlines()]

    assert sorted(ids()) == sorted(
        ["acme/e0", "acme/e1", "acme/e2", "acme/tools", "acme/tools", "acme/open", "globex/e0"]
    )  # the operator: every tenant, stored ids
    assert ids(principal=Principal("globex", frozenset())) == ["e0"]
    assert ids(principal=Principal(None, frozenset())) == []  # the default tenant has none
    assert sorted(ids(min_reward=0.5)) == ["acme/e0", "acme/e2"]
    assert ids(max_reward=0.0) == ["acme/e1"]
    assert ids(agent="nobody") == [] and ids(version=0, trained=True) == []
    assert len(ids(version=0, trained=False)) == 7
    assert ids(task="sum", principal=Principal("globex", frozenset())) == ["e0"]

    out = tmp_path / "cli.parquet"
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": proxy.database_url}
    cli = [sys.executable, "-m", "flywheel", "export"]
    done = subprocess.run(
        [*cli, str(out), "--tenant", "acme", "--min-reward", "0.5", "--tokens"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("2 transitions rows to ") and "/s)" in done.stdout
    assert sorted(datasets.Dataset.from_parquet(str(out))["episode_id"]) == ["e0", "e2"]
    bad = subprocess.run(
        [*cli, str(tmp_path / "x.jsonl"), "--since", "yesterday"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--since" in bad.stderr
    assert not (tmp_path / "x.jsonl").exists()
    # An empty result is a valid Parquet file with the kind's columns and no rows (which
    # `datasets` itself declines to load: "BatchSize must be greater than 0").
    empty = export(proxy.database_url, tmp_path / "none.parquet", where=ExportFilter(agent="x"))
    table = pyarrow.parquet.read_table(empty.path)
    assert empty.rows == table.num_rows == 0 and table.column_names == columns("transitions")


def get_export(proxy: RunningProxy, key: str, **params: Any) -> Any:
    with proxy.client(Authorization=f"Bearer {key}") as c:
        return c.get("/v1/export", params=params)


def test_a_tenant_exports_its_own_rows_over_http(
    recorded: tuple[RunningProxy, str], sessions: Sessions, tmp_path: Path
) -> None:
    proxy, acme = recorded
    r = get_export(proxy, acme, tokens="true")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in r.text.splitlines()]
    # The same rows as `flywheel export --tenant acme --tokens`, token ids included.
    where = ExportFilter(principal=Principal("acme", frozenset()))
    cli = export(proxy.database_url, tmp_path / "acme.jsonl", where=where, tokens=True)
    assert lines == [json.loads(line) for line in cli.path.read_text().splitlines()]
    assert len(lines) == 6 and lines[0]["prompt_token_ids"]
    pairs = get_export(proxy, acme, kind="pairs").text.splitlines()
    assert [json.loads(p)["chosen_return"] for p in pairs] == [1.0]
    assert len(get_export(proxy, acme, min_reward=0.5).text.splitlines()) == 2

    # Another tenant sees its own; a key without `read` is refused; bad filters are 400s.
    globex_read = new_key(sessions, "globex", "read")
    infer_only = new_key(sessions, "acme", "infer")
    proxy.wait_keys(globex_read, infer_only)
    [row] = [json.loads(line) for line in get_export(proxy, globex_read).text.splitlines()]
    assert row["episode_id"] == "e0"
    assert get_export(proxy, infer_only).status_code == 403
    for bad, param in [
        ({"kind": "everything"}, "kind"),
        ({"version": -1}, "version"),
        ({"agent": "a\x00"}, "agent"),
        ({"min_reward": "nan"}, "min_reward"),
        ({"since": "yesterday"}, "since"),
        ({"until": "0.5"}, "until"),  # Schemathesis: read as 1970 where a date-time is declared
        ({"trained": "maybe"}, "trained"),
    ]:
        refused = get_export(proxy, acme, **bad)
        assert refused.status_code == 400, (bad, refused.text)
        assert refused.json()["error"]["param"] == f"query.{param}"

    # Each running export holds a reader connection: one tenant may run one (by default), the
    # proxy two; beyond, 429 at once.
    slots = proxy.services.export_slots
    loop = proxy.services.recorder._task.get_loop()  # type: ignore[union-attr]

    def on_proxy(fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=5)

    assert on_proxy(slots.take, "acme") is None
    try:
        mine = get_export(proxy, acme)
        assert mine.status_code == 429 and mine.json()["error"]["code"] == "too_many_exports"
        assert "FLYWHEEL_EXPORTS_PER_TENANT" in mine.json()["error"]["message"]
        assert get_export(proxy, globex_read).status_code == 200  # another tenant's turn
        # Its slot comes back once its cursor and connection are closed, which the server does
        # after the last byte went out: the client may have the whole body a moment before.
        deadline = time.monotonic() + 5
        while on_proxy(lambda: slots.running.total()) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert on_proxy(slots.take, "initech") is None
        try:
            full = get_export(proxy, globex_read)
            assert full.status_code == 429 and "on this proxy" in full.json()["error"]["message"]
        finally:
            on_proxy(slots.give_back, "initech")
    finally:
        on_proxy(slots.give_back, "acme")
    assert get_export(proxy, acme).status_code == 200


# Big rows for a tenant's export: more than a client's socket buffers hold.
BIG_EPISODES = """
INSERT INTO episode (id, created_at)
SELECT %(tenant)s || '/big-' || g, now() FROM generate_series(1, 400) g"""
BIG_ROWS = """
INSERT INTO transition (id, episode_id, request_id, choice_index, agent_name, requested_at, route,
    status, http_status, model_requested, model_used, message_digests, params, latency_ms, text)
SELECT gen_random_uuid(), e.id, gen_random_uuid(), 0, 'solver', now(), 'chat', 'ok', 200,
    'policy', 'demo', ARRAY[]::bytea[], '{}', 1, repeat('x', 100000)
FROM episode e WHERE starts_with(e.id, %(tenant)s || '/big-')"""


def stalled_export(proxy: RunningProxy, key: str) -> socket.socket:
    """An export whose client reads nothing after asking (a small receive buffer: it fills)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", proxy.settings.port))
    head = f"GET /v1/export HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
    sock.sendall(head.encode() + b"\r\n")
    return sock


@pytest.mark.slow
def test_a_client_that_stops_reading_loses_its_export_slot(
    make_proxy: Any, sessions: Sessions
) -> None:
    proxy = make_proxy(auth="keys", keys_refresh_s=0.1, export_idle_timeout_s=1)
    acme, globex = new_key(sessions, "acme", "read"), new_key(sessions, "globex", "read")
    proxy.wait_keys(acme, globex)
    with psycopg.connect(proxy.database_url, autocommit=True) as conn:
        for tenant in ("acme", "globex"):
            conn.execute(BIG_EPISODES, {"tenant": tenant})
            conn.execute(BIG_ROWS, {"tenant": tenant})
    slots = proxy.services.export_slots
    stalled = [stalled_export(proxy, acme), stalled_export(proxy, globex)]
    try:
        proxy.wait_until(lambda: slots.running.total() == 2, "both exports running")
        # Both slots are held by clients that read nothing: after the idle time, they are cut.
        proxy.wait_until(lambda: slots.running.total() == 0, "the idle exports cut", timeout=15)
        r = get_export(proxy, acme)
        assert r.status_code == 200 and len(r.text.splitlines()) == 400
    finally:
        for sock in stalled:
            sock.close()


def test_a_tenant_may_not_be_given_more_exports_than_the_proxy() -> None:
    with pytest.raises(ValueError, match="FLYWHEEL_EXPORTS_PER_TENANT"):
        ProxySettings(exports_max=2, exports_per_tenant=3)


def test_an_export_whose_response_never_starts_gives_its_connection_back(
    make_proxy: Any,
) -> None:
    """Found by reading: the cursor and its reader connection were closed only in the lines'
    generator's `finally`, which never runs when the response's start is refused (the client
    gone before the headers went out): each such export kept a connection of the readers' pool
    and a server-side cursor for good."""
    proxy = make_proxy()
    app = proxy.server.config.app
    pool = proxy.services.sessionmaker.kw["bind"].sync_engine.pool
    loop = proxy.services.recorder._task.get_loop()  # type: ignore[union-attr]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/v1/export",
        "raw_path": b"/v1/export",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", proxy.settings.port),
    }

    async def gone_before_the_headers() -> int:
        asked = []

        async def receive() -> dict[str, Any]:
            if not asked:
                asked.append(1)
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.sleep(3600)  # (the server says nothing more)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                raise OSError("the client is gone")

        with contextlib.suppress(OSError):
            await app(scope, receive, send)

    for _ in range(5):  # each leaked one stays checked out
        asyncio.run_coroutine_threadsafe(gone_before_the_headers(), loop).result(10)
    # (the proxy's own polls borrow a reader connection now and then: none is kept)
    proxy.wait_until(lambda: pool.checkedout() == 0, "every reader connection back", timeout=5)
    assert proxy.services.export_slots.running.total() == 0
    assert get_export_open(proxy).status_code == 200


def get_export_open(proxy: RunningProxy) -> httpx.Response:
    return httpx.get(proxy.url + "/v1/export", timeout=30)
