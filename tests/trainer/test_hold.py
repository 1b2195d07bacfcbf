"""The gate's `hold` fallback (FLYWHEEL_GATE_FALLBACK=hold, trainer/canary_watch.py): a version the
gate cannot decide is held (a canary on no episode: loaded, served to no one) and the gate is asked
again until it decides. Here the gate's answers are scripted (`rejudge`); what is tested is what
the trainer does with them, on real Postgres. tests/e2e/test_e2e_gate.py holds a version on the
real thing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core import canary, policy
from core.database import Sessions
from demo.tiny_model import build_demo_model
from fakes.vllm import FakeVLLM
from flywheel import adapters, status
from tests.conftest import TEST_HOME, RunningProxy
from tests.core import test_lineages as lineages
from trainer.canary_watch import CanaryWatch
from trainer.config import TrainerSettings
from trainer.gate import Verdict
from trainer.housekeeping import Housekeeper
from trainer.metrics import LineageMetrics
from trainer.vllm import Replicas

PASS = Verdict("pass", "estimated 0.6 against 0.5")
FAIL = Verdict("fail", "estimated 0.2 against 0.5")
UNSURE = Verdict("inconclusive", "3 logged episodes, under the 10 needed")


class Held:
    """A lineage with v1 current and v2 held by the gate, watched with scripted verdicts."""

    def __init__(
        self,
        proxy: RunningProxy,
        fake: FakeVLLM,
        sessions: Sessions,
        tmp_path: Path,
        verdicts: list[Verdict | None],
        **overrides: Any,
    ) -> None:
        self.sessions, self.fake = sessions, fake
        self.settings = TrainerSettings(
            **{
                "model": build_demo_model(TEST_HOME / "models" / "demo"),
                "vllm": [fake.url],
                "adapters_dir": tmp_path,  # where lineages.publish puts them
                "home": tmp_path,
                "database_url": proxy.database_url,
                "metrics_port": 0,
                "retire_grace_s": 0,
                "gate": "ope",
                "gate_fallback": "hold",
                "gate_hold_check_s": 0.001,
            }
            | overrides
        )
        self.v1 = lineages.publish(sessions, fake, tmp_path, "policy")
        self.v2 = lineages.publish(
            sessions, fake, tmp_path, "policy", canary_rule=self.settings.gate_hold_rule
        )
        self.verdicts, self.asked = verdicts, 0
        self.replicas = Replicas(self.settings.vllm, None)
        metrics = LineageMetrics("policy")
        housekeeper = Housekeeper(self.settings, sessions, self.replicas)
        self.watch = CanaryWatch(
            self.settings, sessions, metrics, housekeeper, rejudge=self._rejudge
        )

    def _rejudge(self, test: canary.Canary) -> Verdict | None:
        assert (test.candidate, test.baseline) == (self.v2, self.v1)
        self.asked += 1
        return self.verdicts.pop(0)

    def holds(self) -> bool:
        time.sleep(0.01)  # past gate_hold_check_s
        return self.watch.holds()

    def version(self, version: int) -> policy.Adapter:
        with self.sessions.begin() as session:
            adapter = policy.get(version, session=session)
        assert adapter is not None
        return adapter

    def current(self) -> int | None:
        with self.sessions.begin() as session:
            adapter = policy.current(session=session)
        return adapter.version if adapter else None

    def opened(self) -> canary.Canary | None:
        with self.sessions.begin() as session:
            return canary.opened(session=session).get("policy")

    def history(self) -> list[Any]:
        with self.sessions.begin() as session:
            return canary.history(session=session)

    def decided(self) -> Any:
        return self.history()[0]


@pytest.fixture
def held(
    proxy: RunningProxy, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> Iterator[Any]:
    made: list[Held] = []

    def make(verdicts: list[Verdict | None], **overrides: Any) -> Held:
        made.append(Held(proxy, fake_vllm, sessions, tmp_path, verdicts, **overrides))
        return made[-1]

    yield make
    for h in made:
        h.replicas.close()


def test_a_held_version_serves_no_one_and_waits_until_the_gate_passes_it(held: Any) -> None:
    h = held([UNSURE, None, PASS])
    test = h.opened()
    assert test is not None and test.rule.held and test.fraction == 0
    assert not any(canary.in_canary(f"e{i}", h.v2, test.fraction) for i in range(2000))
    assert h.current() == h.v1
    [lineage] = status.collect(h.sessions).lineages
    assert lineage.canary == f"v{h.v2} held by the gate"
    assert adapters._canary_line(h.history()[0]).endswith(
        ": held by the gate, served to no one, open"
    )
    assert h.holds() and h.holds()  # inconclusive, then the gate could not be asked: waits
    assert h.opened() is not None and h.current() == h.v1
    assert not h.holds()  # pass: promoted, the trainer goes on
    assert h.asked == 3
    assert h.current() == h.v2 and h.opened() is None
    row = h.decided()
    assert (row.action, row.evidence) == ("promote", None)
    assert row.reason.startswith("gate pass: estimated 0.6"), row.reason
    gate = h.version(h.v2).stats["gate"]
    assert gate["outcome"] == "pass" and gate["held_s"] >= 0, gate


def test_a_held_version_the_gate_fails_is_retired_and_unloaded(held: Any) -> None:
    h = held([FAIL])
    assert not h.holds()
    assert h.current() == h.v1
    v2 = h.version(h.v2)
    assert v2.retired_at is not None and v2.stats is not None
    assert v2.stats["gate"]["outcome"] == "fail"
    assert h.decided().action == "rollback"
    assert v2.name not in h.fake.loras  # retire_grace_s 0: unloaded at once


def test_with_canaries_on_a_held_version_that_passes_opens_a_canary(held: Any) -> None:
    h = held([PASS], canary_fraction=0.25)
    assert h.holds()  # now a canary: the trainer still waits
    test = h.opened()
    assert test is not None and (test.candidate, test.baseline) == (h.v2, h.v1)
    assert test.fraction == 0.25 and not test.rule.held
    assert h.current() == h.v1
    assert [r.action for r in h.history()] == [
        None,
        "promote",
    ]  # the canary open, the hold's row closed


@pytest.mark.parametrize(("timeout", "action"), [("reject", "rollback"), ("publish", "promote")])
def test_a_hold_still_undecided_after_its_time_takes_the_timeout_setting(
    held: Any, timeout: str, action: str
) -> None:
    h = held([UNSURE], gate_hold_max_s=0.001, gate_hold_timeout=timeout)
    assert not h.holds()
    row = h.decided()
    assert row.action == action and row.reason.startswith("timeout after"), row.reason
    assert h.current() == (h.v2 if action == "promote" else h.v1)
    assert h.version(h.v2).stats["gate"]["outcome"] == "inconclusive"


def test_a_hand_on_the_policy_supersedes_a_hold(held: Any) -> None:
    h = held([])
    with h.sessions.begin() as session:
        policy.make_current(h.v2, session=session)
    assert h.decided().action == "superseded"
    assert not h.holds() and h.asked == 0  # nothing left to judge
    assert h.current() == h.v2
