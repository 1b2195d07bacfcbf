"""The trainer through faults that are not its batch's (issue 31, finding 5): vLLM down,
Postgres down, a claim lost to a reward. Only a batch's own failure counts towards
max_train_attempts; the rest costs the batch nothing and the trainer backs off, so an outage
never turns credited transitions into `train_failed`. Real Postgres, real training, the fake vLLM
(a URL where nothing listens is a vLLM that is down)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Gauge

from core import database
from core.rollout import NoReplica
from demo.tiny_model import build_demo_model
from demo.vllm_server import free_port
from fakes.vllm import FakeVLLM
from tests.conftest import TEST_HOME, RunningProxy
from tests.trainer.test_trainer_loop import make_trainer, play  # noqa: F401  (a fixture)
from trainer import faults
from trainer.config import TrainerSettings
from trainer.loop import Trainer
from trainer.turns import Turns
from trainer.vllm import Replicas

pytestmark = pytest.mark.slow

# Every transition: (claimed, attempts so far, set aside as, trained by)
FATES = (
    "SELECT claimed_by IS NOT NULL, train_attempts, skip_reason, trained_version, count(*) "
    "FROM transition GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4"
)


def wait_until(condition: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_steps_during_a_vllm_outage_cost_the_batch_nothing(
    proxy: RunningProxy,
    make_trainer: Any,  # noqa: F811
) -> None:
    """Each step trains, finds no vLLM to load into, and gives the batch back uncharged: after
    more steps than max_train_attempts nothing is set aside, and once vLLM is back the batch
    trains."""
    play(proxy)
    port = free_port()
    trainer = make_trainer(vllm=[f"http://127.0.0.1:{port}"], max_train_attempts=2)
    outcomes: list[object] = []
    for _ in range(4):
        try:
            outcomes.append(trainer.step())
        except NoReplica as e:  # given back first, for run() to back off
            outcomes.append(type(e))
        assert proxy.query(FATES) == [(False, 0, None, None, 8)]
    assert outcomes == [NoReplica] * 4
    assert not list(trainer.settings.adapters_dir.iterdir())  # nothing left behind
    with FakeVLLM(port=port) as vllm:  # vLLM is back
        assert trainer.step()
        assert set(vllm.loras) == {"policy-v5"}  # v1-v4: the numbers the outage spent
    assert proxy.query(FATES) == [(False, 1, None, 5, 8)]


def test_a_claim_lost_to_a_reward_costs_the_batch_nothing(
    proxy: RunningProxy,
    make_trainer: Any,  # noqa: F811
    monkeypatch: Any,
) -> None:
    """A reward that moves one return mid-step loses the whole step (it trained on the old
    return); none of the batch is charged for it, the moved row included."""
    play(proxy)
    trainer = make_trainer(max_train_attempts=1)  # one charge would set the batch aside
    real_step = trainer.engine.step

    def step(samples: Any) -> Any:
        monkeypatch.undo()  # once
        with proxy.client() as c:
            r = c.post("/v1/rewards", json={"episode_id": "a-t0-e0", "reward": 0.75})
        assert r.status_code == 200, r.text
        return real_step(samples)

    monkeypatch.setattr(trainer.engine, "step", step)
    assert not trainer.step()  # lost to the reward
    assert proxy.query(FATES) == [(False, 0, None, None, 8)]
    assert trainer.step()
    assert proxy.query(FATES) == [(False, 1, None, 2, 8)]  # v1: the number the loss spent


@pytest.fixture
def trainer_on(fake_vllm: FakeVLLM, tmp_path: Path) -> Iterator[Any]:
    """A trainer on any database (make_trainer's is the test's own)."""
    made: list[tuple[Any, Replicas]] = []

    def make(url: str, **overrides: Any) -> Trainer:
        settings = TrainerSettings(
            **{
                "model": build_demo_model(TEST_HOME / "models" / "demo"),
                "vllm": [fake_vllm.url],
                "adapters_dir": tmp_path / "adapters",
                "home": tmp_path,
                "database_url": url,
                "min_episodes": 4,
                "metrics_port": 0,
                "learning_rate": 1e-3,
            }
            | overrides
        )
        engine, sessions = database.create_sessions(url)
        made.append((engine, Replicas(settings.vllm, None)))
        return Trainer(settings, sessions, made[-1][1])

    yield make
    for engine, replicas in made:
        replicas.close()
        engine.dispose()


def test_postgres_down_at_publish_costs_the_batch_nothing(
    own_postgres: Any, make_proxy: Any, fake_vllm: FakeVLLM, trainer_on: Any
) -> None:
    """Postgres stops while the new adapter loads: the publish fails, the claims cannot go back
    yet. They go back uncharged once Postgres answers, before the next claim (without that they
    stayed claimed until the lease ran out, an attempt spent)."""
    proxy = make_proxy(database_url=own_postgres.url)
    play(proxy)
    proxy.stop()
    trainer = trainer_on(own_postgres.url)
    fake_vllm.load_delay_s = 60
    failed: list[BaseException] = []

    def step() -> None:
        try:
            trainer.step()
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=step)
    thread.start()
    try:
        wait_until(lambda: (trainer.settings.adapters_dir / "policy-v1").exists())  # loading
        own_postgres.stop()
    finally:
        fake_vllm.load_delay_s = 0
        thread.join(120)
    assert len(failed) == 1 and isinstance(failed[0], faults.INFRASTRUCTURE), failed
    own_postgres.start()
    assert trainer.step()  # the held claims went back first: the batch trains at once
    assert proxy.query(FATES) == [(False, 1, None, 2, 8)]  # one attempt: the one that trained


def test_the_trainer_backs_off_while_vllm_is_down_then_trains(
    proxy: RunningProxy,
    make_trainer: Any,  # noqa: F811
) -> None:
    """The trainer process's loop (Turns.run) through an outage: waits that double up to the
    cap, shown in flywheel_trainer_backoff_seconds, back to 0 once a step gets through."""
    play(proxy)
    port = free_port()
    trainer = make_trainer(
        vllm=[f"http://127.0.0.1:{port}"], backoff_s=0.05, backoff_max_s=0.2, max_steps=1
    )
    turns = Turns(trainer.settings, trainer.sessions, trainer.vllm, trainers=[trainer])
    runner = threading.Thread(target=turns.run)
    runner.start()
    try:
        wait_until(lambda: trainer.backoff.failures >= 4)
        assert trainer.backoff.delay_s == 0.2  # 0.05, 0.1, 0.2, 0.2: capped
        assert gauge(trainer.metrics.backoff) > 0
        with FakeVLLM(port=port):
            runner.join(120)
    finally:
        trainer.settings.max_steps = 0  # ends the loop however the test went
        runner.join(120)
    assert trainer.steps == 1 and trainer.backoff.failures == 0
    assert gauge(trainer.metrics.backoff) == 0
    assert proxy.query(FATES) == [(False, 1, None, trainer.parent, 8)]


def gauge(child: Gauge) -> float:
    return float(child._value.get())  # type: ignore[attr-defined]


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    backoff = faults.Backoff(1.0, 5.0, Gauge("test_backoff_seconds", "test", registry=None))
    delays = []
    for _ in range(5):
        backoff.failures += 1
        delays.append(backoff.delay_s)
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.reset()
    assert backoff.delay_s == 0.0
