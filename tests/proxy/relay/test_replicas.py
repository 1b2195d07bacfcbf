"""Several vLLM replicas behind one proxy: spreading, stickiness, ejection, return with the policy.

The choice itself (`Upstream.pick`) is tested as plain logic; the rest runs the real proxy on real
Postgres against fake vLLMs, one of them a separate process so it can be killed mid-traffic.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from core.rollout import NoReplica
from core.vllm import AdapterRejected
from demo.vllm_server import free_port, wait_http
from fakes.vllm import FakeVLLM
from proxy.relay.upstream import Upstream
from tests.conftest import RunningProxy
from trainer.vllm import Replicas

URLS = ["http://a:1", "http://b:1", "http://c:1"]


def chat(episode: str | None, text: str = "hi") -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": "policy", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return body, ({"X-Episode-Id": episode} if episode else {})


def served_by(fake: FakeVLLM) -> list[str]:
    """The user texts of the chat calls a fake answered, in order."""
    return [
        r["body"]["messages"][-1]["content"]
        for r in fake.requests
        if r["path"].endswith("/chat/completions")
    ]


def add_current_adapter(database_url: str, tmp_path: Path, version: int = 1) -> str:
    name, path = f"policy-v{version}", tmp_path / f"policy-v{version}"
    path.mkdir()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE adapter_version SET is_current = false")
        conn.execute(
            "INSERT INTO adapter_version (version, name, path, base_model, is_current) "
            "VALUES (%s, %s, %s, 'demo', true)",
            (version, name, str(path)),
        )
    return name


def loaded(url: str) -> set[str]:
    models = httpx.get(url + "/v1/models").json()["data"]
    return {m["id"] for m in models if m.get("parent")}


def replicas_of(proxy: RunningProxy) -> dict[str, Any]:
    return httpx.get(proxy.url + "/healthz").json()["replicas"]  # type: ignore[no-any-return]


def retries(proxy: RunningProxy) -> float:
    """flywheel_upstream_retries_total (counters are per process: compare before and after)."""
    for line in httpx.get(proxy.url + "/metrics").text.splitlines():
        if line.startswith("flywheel_upstream_retries_total "):
            return float(line.split()[1])
    raise AssertionError("no flywheel_upstream_retries_total in /metrics")


def wait_for(condition: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


class FakeProcess:
    """fakes.vllm as its own process: it can be killed like a crashed vLLM, and restarted."""

    def __init__(self, port: int, latency_s: float, log_dir: Path) -> None:
        self.port, self.latency_s, self.log_dir = port, latency_s, log_dir
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        command = [sys.executable, "-m", "fakes.vllm", "--port", str(self.port)]
        command += ["--latency-s", str(self.latency_s), "--log", str(self.log)]
        self.process = subprocess.Popen(command)
        wait_http(self.url + "/health", self.process, timeout=30)

    @property
    def log(self) -> Path:
        """Requests this run of the process received: {"path", "model"} per line."""
        return self.log_dir / f"fake-{self.port}-{self.starts}.jsonl"

    def requests(self) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [json.loads(line) for line in lines]

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()


@pytest.fixture
def second_fake() -> Iterator[FakeVLLM]:
    with FakeVLLM() as fake:
        yield fake


@pytest.fixture
def fake_process(tmp_path: Path) -> Iterator[FakeProcess]:
    fake = FakeProcess(free_port(), latency_s=0.05, log_dir=tmp_path)
    fake.start()
    yield fake
    if fake.process and fake.process.poll() is None:
        fake.kill()


# --- the choice, as logic -----------------------------------------------------------------


def test_an_episode_keeps_its_replica_while_the_load_is_even() -> None:
    upstream = Upstream(URLS, api_key=None, timeout_s=1)
    homes = {}
    for n in range(60):
        first = upstream.pick(f"ep{n}")
        assert first is not None
        upstream.release(first)
        again = upstream.pick(f"ep{n}")
        assert again is first
        upstream.release(again)
        homes[f"ep{n}"] = first.base_url
    assert set(homes.values()) == set(URLS)  # rendezvous hashing spreads the episodes


def test_an_overloaded_replica_spills_its_episode_to_the_next() -> None:
    upstream = Upstream(URLS, api_key=None, timeout_s=1)
    home = upstream.pick("ep")
    assert home is not None
    home.outstanding += 9  # its own episode's calls pile up there
    spilled = upstream.pick("ep")
    assert spilled is not None and spilled is not home
    # Never above 1.25x the average (rounded up), counting the call being placed.
    assert spilled.outstanding <= -(-1.25 * 11 // 3)


def test_calls_without_an_episode_go_to_the_least_loaded_replica_in_turn() -> None:
    upstream = Upstream(URLS, api_key=None, timeout_s=1)
    upstream.replicas[0].outstanding = 5
    picks = [upstream.pick(None) for _ in range(4)]
    assert [p.base_url for p in picks if p] == [
        "http://b:1",
        "http://c:1",
        "http://b:1",
        "http://c:1",
    ]


def test_ejected_replicas_are_skipped_until_none_is_left() -> None:
    upstream = Upstream(URLS, api_key=None, timeout_s=1)
    a, b, c = upstream.replicas
    upstream.failed(a, "down")
    upstream.failed(b, "down")
    assert {upstream.pick(f"ep{n}") for n in range(20)} == {c}
    assert upstream.pick("ep", exclude=(c,)) in (a, b)  # all out: still try one rather than none
    assert upstream.pick("ep", exclude=(a, b, c)) is None
    upstream.restored(a)
    assert a.in_rotation and a.failures == 0


def test_a_chained_response_goes_where_its_predecessor_was_answered() -> None:
    upstream = Upstream(URLS, api_key=None, timeout_s=1)
    a, b, c = upstream.replicas
    upstream.remember("resp_1", b.base_url)
    a.outstanding = c.outstanding = 0
    b.outstanding = 50  # busier than any bound: it still takes the chained call
    assert upstream.pick(None, previous_response="resp_1") is b
    assert upstream.pick("ep", previous_response="resp_1") is b
    assert upstream.pick(None, previous_response="resp_unknown") in (a, c)
    upstream.failed(b, "down")  # gone: vLLM elsewhere will answer 404, the proxy says why
    assert upstream.pick(None, previous_response="resp_1") in (a, c)


# --- through the proxy --------------------------------------------------------------------


def test_traffic_reaches_both_replicas_and_each_episode_sticks_to_one(
    make_proxy: Any, fake_vllm: FakeVLLM, second_fake: FakeVLLM
) -> None:
    proxy = make_proxy(upstream=[fake_vllm.url, second_fake.url])
    with proxy.client() as client:
        for n in range(6):  # calls without an episode id: one at a time, so they alternate
            body, headers = chat(None, text=f"anon{n}")
            assert client.post("/v1/chat/completions", json=body, headers=headers).is_success
        for turn in range(3):
            for n in range(12):
                body, headers = chat(f"ep{n}", text=f"ep{n} turn{turn}")
                assert client.post("/v1/chat/completions", json=body, headers=headers).is_success
    first, second = served_by(fake_vllm), served_by(second_fake)
    episodes = [{t.split()[0] for t in texts if t.startswith("ep")} for texts in (first, second)]
    assert episodes[0] and episodes[1] and not episodes[0] & episodes[1]
    anon = Counter(t in first for t in first + second if t.startswith("anon"))
    assert anon[True] == anon[False] == 3
    rows = proxy.wait_rows("SELECT id FROM transition", 42)
    assert len(rows) == 42


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_chains_stay_on_the_replica_that_keeps_them(
    make_proxy: Any, fake_vllm: FakeVLLM, second_fake: FakeVLLM, stream: bool
) -> None:
    """Without an episode id, calls alternate between replicas; vLLM keeps a response only on
    the one that answered it, so each chained call must go back there."""
    fake_vllm.store_responses = second_fake.store_responses = True
    proxy = make_proxy(upstream=[fake_vllm.url, second_fake.url])
    previous = None
    with proxy.client() as client:
        for turn in range(6):
            body = {"model": "demo", "input": f"turn {turn}", "max_output_tokens": 4}
            if previous:
                body["previous_response_id"] = previous
            if stream:
                with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                    assert r.status_code == 200, r.read()
                    events = [
                        json.loads(line[5:]) for line in r.iter_lines() if line[:5] == "data:"
                    ]
                previous = events[-1]["response"]["id"]
            else:
                r = client.post("/v1/responses", json=body)
                assert r.status_code == 200, r.text
                previous = r.json()["id"]
    calls = [
        sum(q["path"] == "/v1/responses" for q in f.requests) for f in (fake_vllm, second_fake)
    ]
    assert sorted(calls) == [0, 6]
    assert proxy.wait_rows(
        "SELECT 1 FROM transition WHERE route = 'responses' AND status = 'ok'", 6
    )


@pytest.mark.slow
def test_a_replica_killed_mid_traffic_loses_no_call_and_no_transition(
    make_proxy: Any,
    fake_vllm: FakeVLLM,
    fake_process: FakeProcess,
    database_url: str,
    tmp_path: Path,
) -> None:
    policy = add_current_adapter(database_url, tmp_path)
    fake_vllm.latency_s = 0.05
    proxy = make_proxy(upstream=[fake_vllm.url, fake_process.url], replica_probe_s=0.2)
    assert policy in loaded(fake_process.url) and policy in loaded(fake_vllm.url)  # at start

    retries_before = retries(proxy)
    statuses: list[int] = []
    stop = threading.Event()

    def agent(n: int) -> None:
        with proxy.client() as client:
            turn = 0
            while not stop.is_set():
                body, headers = chat(f"ep{n}-{turn % 3}", text=f"{n} {turn}")
                statuses.append(
                    client.post("/v1/chat/completions", json=body, headers=headers).status_code
                )
                turn += 1

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: len(served_by(fake_vllm)) >= 10)
    fake_process.kill()  # calls in flight there lose their connection mid-generation
    wait_for(lambda: not replicas_of(proxy)[fake_process.url]["in_rotation"])
    time.sleep(0.3)

    fake_process.start()  # restarted: it has lost every adapter
    wait_for(lambda: replicas_of(proxy)[fake_process.url]["in_rotation"])
    wait_for(lambda: any(r["model"] == policy for r in fake_process.requests()))
    stop.set()
    for t in threads:
        t.join()
    # The adapter was loaded into the restarted replica before any policy call reached it.
    paths = [r["path"] for r in fake_process.requests()]
    assert "/v1/chat/completions" in paths
    assert paths.index("/v1/load_lora_adapter") < paths.index("/v1/chat/completions")

    assert statuses and set(statuses) == {200}
    rows = proxy.wait_rows("SELECT status FROM transition", len(statuses))
    assert Counter(s for (s,) in rows) == {"ok": len(statuses)}
    assert retries(proxy) > retries_before  # calls in flight on the killed replica went elsewhere


def test_a_replica_without_the_policy_gets_it_before_any_policy_call(
    make_proxy: Any,
    fake_vllm: FakeVLLM,
    second_fake: FakeVLLM,
    database_url: str,
    tmp_path: Path,
) -> None:
    policy = add_current_adapter(database_url, tmp_path)
    fake_vllm.loras[policy] = str(tmp_path / policy)  # only the first replica has it
    proxy = make_proxy(upstream=[fake_vllm.url, second_fake.url])
    assert second_fake.loras == {policy: str(tmp_path / policy)}  # loaded at start-up
    with proxy.client() as client:
        for n in range(10):
            body, headers = chat(f"ep{n}")
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200 and r.headers["x-policy-version"] == "1"
    assert all(
        r["body"]["model"] == policy
        for fake in (fake_vllm, second_fake)
        for r in fake.requests
        if r["path"].endswith("/chat/completions")
    )


def test_a_replica_that_refuses_the_policy_stays_out(
    make_proxy: Any,
    fake_vllm: FakeVLLM,
    second_fake: FakeVLLM,
    database_url: str,
    tmp_path: Path,
) -> None:
    policy = add_current_adapter(database_url, tmp_path)
    fake_vllm.loras[policy] = str(tmp_path / policy)
    second_fake.max_lora_rank = 0  # refuses every adapter with a config
    (tmp_path / policy / "adapter_config.json").write_text('{"r": 8}')
    proxy = make_proxy(upstream=[fake_vllm.url, second_fake.url], replica_probe_s=0.1)
    assert not replicas_of(proxy)[second_fake.url]["in_rotation"]
    with proxy.client() as client:
        for n in range(6):
            body, headers = chat(f"ep{n}")
            assert client.post("/v1/chat/completions", json=body, headers=headers).is_success
    assert served_by(second_fake) == []


def test_one_lineages_adapter_a_replica_refuses_does_not_keep_the_others_away(
    make_proxy: Any,
    fake_vllm: FakeVLLM,
    second_fake: FakeVLLM,
    database_url: str,
    tmp_path: Path,
) -> None:
    """Issue 12: the second replica cannot load the writer's adapter (rank 16 > its 8); it still
    serves the rewriter's and the base model's calls, and the writer's all go to the first."""
    writer, rewriter = tmp_path / "writer-v1", tmp_path / "rewriter-v2"
    with psycopg.connect(database_url, autocommit=True) as conn:
        for version, path, rank in ((1, writer, 16), (2, rewriter, 8)):
            path.mkdir()
            (path / "adapter_config.json").write_text(json.dumps({"r": rank}))
            conn.execute(
                "INSERT INTO adapter_version (version, lineage, name, path, base_model, "
                "is_current) VALUES (%s, %s, %s, %s, 'demo', true)",
                (version, path.name.split("-")[0], path.name, str(path)),
            )
    fake_vllm.max_lora_rank, second_fake.max_lora_rank = 16, 8
    proxy = make_proxy(
        upstream=[fake_vllm.url, second_fake.url], adapter_per_agent="writer,rewriter"
    )
    assert set(fake_vllm.loras) == {"writer-v1", "rewriter-v2"}
    assert set(second_fake.loras) == {"rewriter-v2"}  # loaded; the writer's refused
    assert replicas_of(proxy)[second_fake.url]["in_rotation"]
    with proxy.client() as client:
        for n in range(12):
            for agent in ("writer", "rewriter", "checker"):
                body, headers = chat(f"ep{n}", text=agent)
                r = client.post(
                    "/v1/chat/completions", json=body, headers=headers | {"X-Agent-Name": agent}
                )
                assert r.status_code == 200, r.text
    assert "writer" not in served_by(second_fake)
    assert {"rewriter", "checker"} <= set(served_by(second_fake))
    assert served_by(fake_vllm).count("writer") == 12


def test_rollback_with_a_replica_down_moves_the_alias_and_heals_it_later(
    make_proxy: Any,
    fake_vllm: FakeVLLM,
    fake_process: FakeProcess,
    database_url: str,
    tmp_path: Path,
) -> None:
    add_current_adapter(database_url, tmp_path, version=1)
    add_current_adapter(database_url, tmp_path, version=2)
    proxy = make_proxy(
        upstream=[fake_vllm.url, fake_process.url], admin_key="root", replica_probe_s=0.2
    )
    fake_process.kill()
    r = proxy.client(Authorization="Bearer root").post("/admin/adapters/1/activate")
    assert r.status_code == 200, r.text
    assert "policy-v1" in fake_vllm.loras
    fake_process.start()
    wait_for(lambda: replicas_of(proxy)[fake_process.url]["in_rotation"])
    assert "policy-v1" in loaded(fake_process.url)


# --- the trainer's side -------------------------------------------------------------------


def test_the_trainer_loads_into_every_reachable_replica(
    fake_vllm: FakeVLLM, second_fake: FakeVLLM, tmp_path: Path
) -> None:
    path = tmp_path / "policy-v1"
    path.mkdir()
    dead = f"http://127.0.0.1:{free_port()}"
    admin = Replicas([fake_vllm.url, dead, second_fake.url], None)
    lone = Replicas([dead], None)
    try:
        rollout = admin.load_everywhere("policy-v1", str(path))
        assert "policy-v1" in fake_vllm.loras and "policy-v1" in second_fake.loras
        assert rollout.loaded == [fake_vllm.url, second_fake.url] and rollout.unreachable == [dead]
        with pytest.raises(NoReplica, match="no vLLM replica reachable"):
            lone.load_everywhere("policy-v2", str(path))
        # A refusal anywhere unloads it from the replicas that took it.
        (path / "adapter_config.json").write_text('{"r": 8}')
        second_fake.max_lora_rank = 4
        with pytest.raises(AdapterRejected):
            admin.load_everywhere("policy-v3", str(path))
        assert "policy-v3" not in fake_vllm.loras
    finally:
        admin.close()
        lone.close()
