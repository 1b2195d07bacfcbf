"""Canary releases (issue 14, part 2): the test that decides, the split that every proxy agrees
on, the lifecycle on real Postgres, and the trainer that opens, waits on and decides a canary
(real TRL steps, the fake vLLM's adapter endpoints, episodes through the real proxy)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from core import canary, naming, policy, retirement
from core.canary import Evidence, Rule
from core.database import Sessions
from core.stats import t_sf, welch
from fakes.vllm import FakeVLLM
from tests.conftest import RunningProxy
from tests.core import test_lineages as lineages
from tests.trainer.test_trainer_loop import make_trainer  # noqa: F401  (a fixture)

RULE = Rule(fraction=0.5, min_episodes=8, alpha=0.05, margin=0.02, max_s=600, fallback="rollback")


# --- the test ----------------------------------------------------------------------------------


def test_student_t_tail_and_welch_match_scipys_figures() -> None:
    # Reference values from scipy.stats 1.17 (t.sf, ttest_ind(equal_var=False)).
    assert t_sf(2.0, 10) == pytest.approx(0.036694017385370, rel=1e-12)
    assert t_sf(-1.3, 3.5) == pytest.approx(0.863702292097815, rel=1e-12)
    assert t_sf(5.0, 200) == pytest.approx(6.250990638857704e-07, rel=1e-9)
    assert t_sf(0.0, 7) == 0.5
    a, b = [0.1, 0.4, 0.35, 0.8, 0.6], [0.2, 0.25, 0.1, 0.3]
    w = welch(a, b)
    assert w.p_greater() == pytest.approx(0.05884497512166446, rel=1e-9)
    assert w.df == pytest.approx(4.996533795493935, rel=1e-9)
    assert w.p_less() == pytest.approx(1 - w.p_greater(), rel=1e-12)
    with pytest.raises(ValueError, match="two values"):
        welch([1.0], [1.0, 2.0])


def rewards(mean: float, n: int, seed: int, task: str | None = None) -> list[canary.ArmEpisode]:
    """n episodes one second apart, each rewarded 1 with probability `mean`."""
    rng = random.Random(seed)
    return [canary.ArmEpisode(float(i), task, float(rng.random() < mean)) for i in range(n)]


def test_a_clearly_worse_candidate_is_rolled_back_a_clearly_better_one_promoted() -> None:
    worse = canary.weigh(rewards(0.2, 60, 1), rewards(0.7, 60, 2), RULE)
    assert canary.decide(worse, RULE, age_s=1) == canary.Decision("rollback", "worse", worse)
    better = canary.weigh(rewards(0.9, 60, 3), rewards(0.5, 60, 4), RULE)
    assert canary.decide(better, RULE, age_s=1) == canary.Decision("promote", "not_worse", better)
    assert better.candidate_episodes == 60 and better.candidate_mean == pytest.approx(0.9, abs=0.1)
    # 60 episodes an arm: look 2 (8 * 2**2 = 32 each) tested the first 32, at 0.05 / 8.
    assert (better.look, better.level, better.tested) == (2, 0.05 / 8, (32, 32))


def test_too_few_episodes_wait_then_the_fallback_decides() -> None:
    few = canary.weigh(rewards(0.0, 5, 1), rewards(1.0, 60, 2), RULE)  # below min_episodes
    assert few.look is None and few.p_worse is None  # however clear, no test on 5 episodes
    assert canary.decide(few, RULE, age_s=1) is None
    assert canary.decide(few, RULE, age_s=600) == canary.Decision("rollback", "timeout", few)
    promote_after = Rule(fraction=0.5, max_s=10, fallback="promote")
    none = canary.weigh([], [], promote_after)
    assert none == Evidence(0, 0, None, None)
    assert canary.decide(none, promote_after, age_s=11) == canary.Decision(
        "promote", "timeout", none
    )


def test_between_looks_the_answer_does_not_change() -> None:
    """Look 1 at 16 episodes an arm: the 17th to 31st episodes are not tested until look 2."""
    c, b = rewards(0.5, 31, 5), rewards(0.5, 31, 6)
    at_16 = canary.weigh(c[:16], b[:16], RULE)
    at_31 = canary.weigh(c, b, RULE)
    assert at_16.look == at_31.look == 1 and at_31.tested == (16, 16)
    assert (at_16.p_worse, at_16.p_not_worse) == (at_31.p_worse, at_31.p_not_worse)
    assert at_31.candidate_episodes == 31  # reported, not yet tested


@pytest.mark.slow
def test_checking_again_and_again_rolls_back_an_equal_candidate_no_more_than_alpha() -> None:
    """The trainer checks every few seconds. Simulated: 400 canaries whose candidate is exactly
    as good as the baseline (reward 1 with probability 0.5), checked after every 4 new episodes
    of each arm up to 256. Testing all the data at every check at level alpha rolls back far
    more than alpha of them; testing only at the looks keeps it under alpha."""
    rule = Rule(fraction=0.5, min_episodes=16, alpha=0.05, margin=0.0)
    rng = random.Random(11)
    looks_wrong = naive_wrong = 0
    for _ in range(400):
        c = [canary.ArmEpisode(float(i), None, float(rng.random() < 0.5)) for i in range(256)]
        b = [canary.ArmEpisode(float(i), None, float(rng.random() < 0.5)) for i in range(256)]
        looked = naive = False
        for n in range(16, 257, 4):
            evidence = canary.weigh(c[:n], b[:n], rule)
            looked = looked or (canary.decide(evidence, rule, 0) or PASS).action == "rollback"
            w = welch([r for *_, r in c[:n]], [r for *_, r in b[:n]])
            naive = naive or w.p_less() < rule.alpha
        looks_wrong += looked
        naive_wrong += naive
    assert looks_wrong / 400 <= 0.05, looks_wrong
    assert naive_wrong / 400 > 0.1, naive_wrong  # what the looks are for


PASS = canary.Decision("promote", "", Evidence(0, 0, None, None))


def test_a_task_mix_that_differs_between_the_arms_does_not_decide() -> None:
    """Same policy, but the candidate drew mostly the hard task: raw means say 'worse'."""
    hard, easy = ("hard", 0.0), ("easy", 1.0)
    candidate = [
        canary.ArmEpisode(float(i), *row) for i, row in enumerate([hard, easy] * 5 + [hard] * 30)
    ]
    baseline = [
        canary.ArmEpisode(float(i), *row) for i, row in enumerate([hard, easy] * 5 + [easy] * 30)
    ]
    evidence = canary.weigh(candidate, baseline, RULE)
    assert evidence.candidate_mean == 0.125 and evidence.baseline_mean == 0.875
    assert evidence.tested == (32, 32)
    assert evidence.p_worse == 1.0  # within each task the two are the same
    assert canary.decide(evidence, RULE, age_s=1) == canary.Decision(
        "promote", "not_worse", evidence
    )


def test_the_split_is_a_stable_fraction_of_episodes_and_differs_per_candidate() -> None:
    episodes = [f"ep-{i}" for i in range(20_000)]
    chosen = {e for e in episodes if canary.in_canary(e, 7, 0.1)}
    assert 0.09 < len(chosen) / len(episodes) < 0.11
    assert chosen == {e for e in episodes if canary.in_canary(e, 7, 0.1)}  # deterministic
    other = {e for e in episodes if canary.in_canary(e, 8, 0.1)}
    assert len(chosen & other) < 0.2 * len(chosen)  # another candidate, other episodes
    assert not any(canary.in_canary(e, 7, 0.0) for e in episodes[:1000])


# --- the lifecycle on Postgres -----------------------------------------------------------------


def publish(
    sessions: Sessions, fake: FakeVLLM, tmp_path: Path, rule: Rule | None, lineage: str = "policy"
) -> int:
    return lineages.publish(sessions, fake, tmp_path, lineage, canary_rule=rule)


def test_a_candidate_is_not_current_until_promoted(
    sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    v1 = publish(sessions, fake_vllm, tmp_path, None)
    v2 = publish(sessions, fake_vllm, tmp_path, RULE)
    with sessions.begin() as session:
        assert policy.current(session=session).version == v1  # type: ignore[union-attr]
        test = canary.opened(session=session)["policy"]
    assert (test.candidate, test.baseline, test.fraction, test.rule) == (v2, v1, 0.5, RULE)
    with pytest.raises(policy.CanaryOpen):  # one at a time
        publish(sessions, fake_vllm, tmp_path, RULE)
    with sessions.begin() as session:
        retirement.mark_retired(session=session, lineage="policy", keep=1)  # spares the candidate
        assert policy.get(v2, session=session).retired_at is None  # type: ignore[union-attr]
    evidence = Evidence(8, 8, 0.9, 0.5, 0, 0.025, (8, 8), 0.9, 0.01)
    with sessions.begin() as session:
        decision = canary.Decision("promote", "not_worse", evidence)
        assert policy.decide_canary(test, decision, session=session)
        assert not policy.decide_canary(test, decision, session=session)  # closed already
    with sessions.begin() as session:
        assert policy.current(session=session).version == v2  # type: ignore[union-attr]
        assert canary.opened(session=session) == {}
        [row] = canary.history(session=session)
    assert (row.action, row.reason, row.evidence["p_not_worse"]) == ("promote", "not_worse", 0.01)


def test_a_rolled_back_candidate_is_retired_and_a_hand_supersedes_a_canary(
    sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    v1 = publish(sessions, fake_vllm, tmp_path, RULE)  # the base model is the baseline
    with sessions.begin() as session:
        test = canary.opened(session=session)["policy"]
        assert test.baseline == policy.BASE_VERSION
        evidence = Evidence(8, 8, 0.1, 0.5, 0, 0.025, (8, 8), 0.001, 0.9)
        policy.decide_canary(test, canary.Decision("rollback", "worse", evidence), session=session)
    with sessions.begin() as session:
        assert policy.current(session=session) is None
        assert policy.get(v1, session=session).retired_at is not None  # type: ignore[union-attr]
        with pytest.raises(policy.RetiredVersion):
            policy.make_current(v1, session=session)
    v2 = publish(sessions, fake_vllm, tmp_path, RULE)
    with sessions.begin() as session:  # what `flywheel adapters activate 0` does
        policy.make_current(None, session=session, lineage="policy")
    with sessions.begin() as session:
        assert canary.opened(session=session) == {}
        rows = canary.history(session=session)
        assert policy.get(v2, session=session).retired_at is None  # type: ignore[union-attr]
    assert [(r.candidate, r.action) for r in rows] == [(v2, "superseded"), (v1, "rollback")]
    assert rows[0].reason == "made the base model current"


def test_canaries_are_per_lineage(sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path) -> None:
    w = publish(sessions, fake_vllm, tmp_path, RULE, lineage="writer")
    r = publish(sessions, fake_vllm, tmp_path, RULE, lineage="rewriter")
    with sessions.begin() as session:
        opened = canary.opened(session=session)
        policy.make_current(None, session=session, lineage="writer")  # closes only the writer's
    assert {k: v.candidate for k, v in opened.items()} == {"writer": w, "rewriter": r}
    with sessions.begin() as session:
        assert set(canary.opened(session=session)) == {"rewriter"}


def test_a_tenants_canaries_are_those_of_its_lineages(
    sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    """`history(tenant=...)` matches `naming.tenant_of_lineage` (a `_` in a tenant's name is
    no LIKE wildcard)."""
    names = ["policy", "writer", "a_b.policy", "axb.policy", "a_b.writer"]
    for lineage in names:
        publish(sessions, fake_vllm, tmp_path, RULE, lineage=lineage)
    with sessions.begin() as session:
        for tenant in (None, "a_b", "axb", "a"):
            shown = {r.lineage for r in canary.history(session=session, tenant=tenant)}
            assert shown == {n for n in names if naming.tenant_of_lineage(n) == tenant}, tenant
        assert {r.lineage for r in canary.history(session=session)} == set(names)


# --- through the proxy -------------------------------------------------------------------------


def call(proxy: RunningProxy, episode: str, task: str = "t") -> str:
    with proxy.client() as c:
        r = c.post(
            "/v1/chat/completions",
            headers={"X-Episode-Id": episode, "X-Task-Id": task},
            json={"model": "policy", "messages": [{"role": "user", "content": "q"}]},
        )
    assert r.status_code == 200, r.text
    return r.headers["x-policy-version"]


def wait_until_open(proxy: RunningProxy, candidate: int) -> None:
    deadline = time.monotonic() + 5
    while True:
        with proxy.client() as c:
            if c.get("/healthz").json()["canaries"].get("policy", {}).get("candidate") == candidate:
                return
        assert time.monotonic() < deadline, "the proxy never saw the canary"
        time.sleep(0.05)


@pytest.mark.slow
def test_the_proxy_splits_by_episode_and_records_each_arm(
    proxy: RunningProxy, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    v1 = publish(sessions, fake_vllm, tmp_path, None)
    v2 = publish(sessions, fake_vllm, tmp_path, Rule(fraction=0.3))
    wait_until_open(proxy, v2)
    episodes = [f"e{i}" for i in range(60)]
    first = {e: call(proxy, e) for e in episodes}
    assert {e: call(proxy, e) for e in episodes} == first  # an episode never changes version
    expected = {e: str(v2 if canary.in_canary(e, v2, 0.3) else v1) for e in episodes}
    assert first == expected
    assert 5 < list(first.values()).count(str(v2)) < 35
    # Rewarded episodes are each arm's evidence: the candidate's got 1, the baseline's 0.
    with proxy.client() as c:
        for e, version in first.items():
            reward = 1.0 if version == str(v2) else 0.0
            assert (
                c.post("/v1/rewards", json={"episode_id": e, "reward": reward}).status_code == 200
            )
    with sessions.begin() as session:
        test = canary.opened(session=session)["policy"]
        arm_c, arm_b = canary.evidence_rows(test, session=session)
    assert len(arm_c) == list(first.values()).count(str(v2)) and {r for *_, r in arm_c} == {1.0}
    assert len(arm_b) == 60 - len(arm_c) and {r for *_, r in arm_b} == {0.0}
    assert {t for _, t, _ in arm_c + arm_b} == {"t"}


# --- the trainer ----------------------------------------------------------------------------------


def play_rewarded(proxy: RunningProxy, n: int, prefix: str, reward_of: dict[str, float]) -> None:
    """n episodes of two tasks; the reward depends on the version that served the episode."""
    with proxy.client() as c:
        for i in range(n):
            episode = f"{prefix}-{i}"
            version = call(proxy, episode, task=f"t{i % 2}")
            reward = reward_of.get(version, float((i // 2) % 2))
            assert (
                c.post("/v1/rewards", json={"episode_id": episode, "reward": reward}).status_code
                == 200
            )


@pytest.mark.slow
@pytest.mark.parametrize("candidate_reward", [0.0, 1.0])
def test_the_trainer_opens_waits_on_and_decides_its_canary(
    proxy: RunningProxy,
    make_trainer: Any,  # noqa: F811
    sessions: Sessions,
    fake_vllm: FakeVLLM,
    candidate_reward: float,
) -> None:
    trainer = make_trainer(
        canary_fraction=0.5, canary_min_episodes=6, canary_check_s=0.01, canary_margin=0.05
    )
    play_rewarded(proxy, 8, "warm", {})
    assert trainer.step()
    with sessions.begin() as session:
        assert policy.current(session=session) is None  # still the base model
        test = canary.opened(session=session)["policy"]
        candidate = policy.get(1, session=session)
    assert candidate is not None and Path(candidate.path).exists()
    assert test.candidate == 1 and test.baseline == 0
    wait_until_open(proxy, 1)

    # While it is open the trainer trains nothing, though there is data.
    rewards = {"1": candidate_reward, "0": 1.0 - candidate_reward}
    play_rewarded(proxy, 6, "early", rewards)  # too few episodes per arm to decide
    assert not trainer.step()
    assert proxy.query("SELECT count(*) FROM transition WHERE trained_at IS NULL") == [(6,)]

    # Enough episodes: the next step decides, then trains from whatever is current.
    play_rewarded(proxy, 40, "canary", rewards)
    assert trainer.step()
    with sessions.begin() as session:
        child, decided = canary.history(session=session)
        adapter = policy.get(child.candidate, session=session)
        current = policy.current(session=session)
    assert child.decided_at is None and decided.candidate == 1
    assert decided.evidence["candidate_episodes"] >= 6
    assert decided.evidence["baseline_episodes"] >= 6
    assert adapter is not None and adapter.stats is not None
    if candidate_reward == 0.0:
        assert (decided.action, decided.reason) == ("rollback", "worse")
        assert current is None
        assert "policy-v1" not in fake_vllm.loras  # unloaded
        assert not Path(candidate.path).exists()  # deleted
        assert adapter.stats["parent"] is None  # the rolled-back candidate has no child
    else:
        assert (decided.action, decided.reason) == ("promote", "not_worse")
        assert current is not None and current.version == 1
        assert adapter.stats["parent"] == 1


# --- what an operator sees -----------------------------------------------------------------------


@pytest.mark.slow
def test_admin_and_cli_show_open_and_decided_canaries(
    make_proxy: Any, sessions: Sessions, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    proxy = make_proxy(admin_key="root")
    v1 = publish(sessions, fake_vllm, tmp_path, RULE)
    with sessions.begin() as session:
        test = canary.opened(session=session)["policy"]
        evidence = Evidence(9, 11, 0.1, 0.6, 0, 0.025, (9, 11), 0.002, 0.97)
        policy.decide_canary(test, canary.Decision("rollback", "worse", evidence), session=session)
    v2 = publish(sessions, fake_vllm, tmp_path, RULE)

    with proxy.client(Authorization="Bearer root") as c:
        listed = c.get("/admin/canaries").json()["data"]
        assert c.get("/admin/canaries?limit=0").status_code == 400
        assert c.get("/admin/canaries?lineage=writer").json()["data"] == []
    assert [(r["candidate"], r["action"]) for r in listed] == [(v2, None), (v1, "rollback")]
    assert listed[1]["evidence"]["p_worse"] == 0.002 and listed[1]["rule"]["min_episodes"] == 8
    with proxy.client() as c:
        assert c.get("/admin/canaries").status_code == 401

    env = {**os.environ, "FLYWHEEL_DATABASE_URL": proxy.database_url}
    cli = [sys.executable, "-m", "flywheel", "adapters"]
    shown = subprocess.run([*cli, "canaries"], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert f"policy: v{v2} vs v0 on 50% of episodes, open" in lines[0]
    assert f"policy: v{v1} vs v0: rollback (worse)" in lines[1]
    assert "reward 0.100 on 9 episodes vs 0.600 on 11 | p(worse) 0.002" in lines[1]
    listed_cli = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, timeout=60)
    assert f"serving the base model; canary policy-v{v2} on 50% of episodes" in listed_cli.stdout
    assert f"c v{v2}" in listed_cli.stdout


@pytest.mark.slow
def test_a_canary_opened_during_a_step_sends_the_batch_back_without_counting_an_attempt(
    proxy: RunningProxy,
    make_trainer: Any,  # noqa: F811
    sessions: Sessions,
    fake_vllm: FakeVLLM,
    tmp_path: Path,
    monkeypatch: Any,
) -> None:
    trainer = make_trainer(canary_fraction=0.5, canary_check_s=0.01)
    play_rewarded(proxy, 8, "warm", {})
    real_step = trainer.engine.step
    opened: list[int] = []

    def step(samples: Any) -> Any:  # someone publishes a candidate by hand meanwhile
        opened.append(publish(sessions, fake_vllm, tmp_path, RULE))
        return real_step(samples)

    monkeypatch.setattr(trainer.engine, "step", step)
    assert not trainer.step()
    [hand] = opened
    with sessions.begin() as session:
        assert canary.opened(session=session)["policy"].candidate == hand
        assert [a.version for a in policy.versions(session=session)] == [hand]
    assert sorted(fake_vllm.loras) == [f"policy-v{hand}"]  # the trainer's own was unloaded
    assert proxy.query(
        "SELECT claimed_by, train_attempts, trained_at, skip_reason, count(*) FROM transition "
        "GROUP BY 1, 2, 3, 4"
    ) == [(None, 0, None, None, 8)]
