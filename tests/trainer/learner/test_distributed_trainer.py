"""`flywheel trainer` on 2 processes (torchrun, and accelerate launch with deploy/accelerate/
ddp.yaml and fsdp2.yaml; gloo): rank 0 claims, steps with the other rank, publishes one version
per step; a rank lost mid-step stops the trainer with every claim back and nothing published;
the promotion gate's estimate is one process's. Real Postgres, real TRL training, the proxy on
the fake vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from core import policy
from core.database import Sessions
from demo.tiny_model import build_demo_model
from demo.vllm_server import free_port
from fakes.vllm import FakeVLLM
from tests.conftest import TEST_HOME, RunningProxy
from tests.trainer.test_trainer_loop import play
from trainer import candidate, turns
from trainer.config import TrainerSettings
from trainer.data import logged
from trainer.data.sampling import server_defaults
from trainer.learner import distributed
from trainer.learner.engine import Engine

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# what a user types (deploy/accelerate/*.yaml), here on CPUs (gloo; no GPU, so no NCCL)
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2"]
FSDP2 = "accelerate-fsdp2"


def launch(
    proxy: RunningProxy,
    fake_vllm: FakeVLLM,
    tmp_path: Path,
    *more: str,
    die: int | None = None,
    fail: int | None = None,
    launcher: str = "torchrun",
) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    trainer = [
        *("trainer", "--model", str(build_demo_model(TEST_HOME / "models" / "demo"))),
        *("--vllm", fake_vllm.url, "--adapters-dir", str(tmp_path / "adapters")),
        *("--home", str(tmp_path), "--database-url", proxy.database_url),
        *("--min-episodes", "4", "--max-batch-transitions", "4", "--metrics-port", "0"),
        *("--learning-rate", "1e-3", "--poll-s", "0.2", *more),
    ]
    if launcher.startswith("accelerate"):  # accelerate-ddp, accelerate-fsdp2
        config = ROOT / "deploy" / "accelerate" / f"{launcher.split('-')[1]}.yaml"
        command = [*ACCELERATE, "--config_file", str(config)]
        command += ["--main_process_port", str(free_port()), "-m", "flywheel"]
    else:
        fault = ["--die-at-step", str(die)] if die is not None else []
        fault += ["--fail-at-step", str(fail)] if fail is not None else []
        # a module from the root: as a script, tests/ (whose folders mirror the packages'
        # names) would come first on sys.path
        command = [*TORCHRUN, "-m", "tests.distributed_trainer_worker", *fault]
    return subprocess.run(
        [*command, *trainer],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
    )


def transitions(sessions: Sessions) -> list[Any]:
    with sessions.begin() as session:
        return list(
            session.execute(
                text("SELECT trained_version, claimed_by, train_attempts FROM transition")
            ).all()
        )


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate-ddp", "accelerate-fsdp2"])
def test_rank_0_claims_and_publishes_one_version_per_step(
    proxy: RunningProxy, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path, launcher: str
) -> None:
    play(proxy, tasks=2)  # 8 transitions: two batches of 4
    run = launch(proxy, fake_vllm, tmp_path, "--max-steps", "2", launcher=launcher)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "rank 1 following rank 0" in run.stderr
    sharded = "the base model sharded over 2 ranks (FSDP2)"
    assert (sharded in run.stderr) == (launcher == "accelerate-fsdp2")
    with sessions.begin() as session:
        versions = policy.versions(session=session, lineage="policy")
        current = policy.current(session=session)
    assert [v.version for v in versions] == [1, 2]  # one version per step, not one per rank
    assert current is not None and fake_vllm.loras[current.name] == current.path
    rows = transitions(sessions)
    assert len(rows) == 8 and {r.trained_version for r in rows} == {1, 2}
    assert all(r.claimed_by is None and r.train_attempts == 1 for r in rows)
    if launcher == "accelerate-fsdp2":  # started again: from version 2, which rank 0 reads and
        play(proxy, tasks=1, agent="b")  # hands to rank 1 (built on the meta device)
        again = launch(proxy, fake_vllm, tmp_path, "--max-steps", "1", launcher=launcher)
        assert again.returncode == 0, again.stderr[-4000:]
        with sessions.begin() as session:
            versions = policy.versions(session=session, lineage="policy")
        assert [v.version for v in versions] == [1, 2, 3]


def test_a_rank_lost_mid_step_stops_the_trainer_with_every_claim_back(
    proxy: RunningProxy, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> None:
    play(proxy, tasks=1)
    run = launch(proxy, fake_vllm, tmp_path, "--max-steps", "1", die=1)
    assert run.returncode != 0
    with sessions.begin() as session:
        assert policy.versions(session=session, lineage="policy") == []  # nothing published
    rows = transitions(sessions)
    assert len(rows) == 4
    assert all(r.trained_version is None and r.claimed_by is None for r in rows)
    # not charged: rank 0 either sees the collective fail ("a rank is gone mid-step") or is
    # stopped by the launcher first (SIGTERM), and both give the claims back uncharged
    assert all(r.train_attempts == 0 for r in rows)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_that_fails_on_any_rank_stops_the_group_and_charges_the_batch(
    proxy: RunningProxy, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path, rank: int
) -> None:
    """The other rank may be inside the step's collectives: the group stops (the launcher
    restarts it) and, as with one process, the batch is charged an attempt, so one that always
    fails is set aside after max_train_attempts instead of stopping the group forever. Rank 1
    exits on it; rank 0 (stopped by the launcher, or its collective broken) charges the batch
    because rank 1 left word."""
    play(proxy, tasks=1)
    run = launch(proxy, fake_vllm, tmp_path, "--max-steps", "1", fail=rank)
    assert run.returncode != 0
    where = "rank 0" if rank == 0 else "another rank (rank 1: ValueError"
    assert f"the step failed on {where}" in run.stderr
    with sessions.begin() as session:
        assert policy.versions(session=session, lineage="policy") == []
    rows = transitions(sessions)
    assert all(r.trained_version is None and r.claimed_by is None for r in rows)
    assert [r.train_attempts for r in rows] == [1, 1, 1, 1]


def test_the_gates_estimate_on_two_processes_is_one_processs(
    proxy: RunningProxy, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> None:
    """FLYWHEEL_GATE=ope under accelerate launch with FSDP2, the base sharded (every forward
    pass needs both ranks): each new version's off-policy estimate is made with its forward
    passes dealt out to both ranks (trainer/learner/ranks.py `Led.score`, and `Led.at` for the
    calls an older version served), the gate decides, and the figures are the ones one process
    makes from the same adapters and window, to float rounding (a rank scoring under the wrong
    weights moved them by 1e-4). The fake vLLM's logprobs are not the model's: every
    transition is let through the off-policy mask, and no weight is 1."""
    play(proxy, tasks=4, episodes_per_task=8)
    ope = {"ope": "log", "ope_holdout": 0.3, "ope_min_ess": 1.0, "ope_resamples": 20}
    ope |= {"gate_min_weight": 1e-6, "off_policy_bound": 1e6, "off_policy_veto": 0.0}
    flags = ["--gate", "ope"]
    flags += [x for k, v in ope.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    first = launch(proxy, fake_vllm, tmp_path, "--max-steps", "1", *flags, launcher=FSDP2)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "the base model sharded over 2 ranks (FSDP2)" in first.stderr
    v1, window = published(sessions, version=1)
    # started again from v1: v2's window holds held-out calls the base served, scored under
    # v1's weights on both ranks
    again = launch(proxy, fake_vllm, tmp_path, "--max-steps", "1", *flags, launcher=FSDP2)
    assert again.returncode == 0, again.stderr[-4000:]
    v2, window_2 = published(sessions, version=2)
    assert v2.stats is not None and v2.stats["ope"]["rescored"] > 0

    one = TrainerSettings(
        model=build_demo_model(TEST_HOME / "models" / "demo"),
        vllm=[fake_vllm.url],
        adapters_dir=tmp_path / "one",
        home=tmp_path / "one",
        **ope,  # type: ignore[arg-type]
    )
    engine = Engine(one)
    for version, parent, calls in ((v1, None, window), (v2, v1, window_2)):
        engine.load_adapter(Path(parent.path) if parent else None)
        weights = engine.snapshot()
        engine.load_adapter(Path(version.path))
        alone = candidate.evaluate(
            engine,
            engine.at(weights),
            calls,
            one,
            current_version=parent.version if parent else policy.BASE_VERSION,
            sampling_defaults=server_defaults(one.generation_config, one.model),
            limits=engine.limits,
        ).stats()
        assert version.stats is not None and version.stats["gate"]["outcome"]
        two = version.stats["ope"]
        assert (alone["episodes"], alone["calls"]) == (two["episodes"], two["calls"]) != (0, 0)
        assert two["candidate"]["mean_weight"] != pytest.approx(1.0, abs=1e-3)
        # Float rounding of values about 2.5e-3: sharded sums round differently (a few 1e-9),
        # and the difference of two such values (about 3e-5) keeps their absolute error.
        for side in ("candidate", "current", "difference"):
            for key in ("value", "low", "high", "mean_weight"):
                assert alone[side][key] == pytest.approx(two[side][key], rel=1e-5, abs=1e-7), (
                    side,
                    key,
                )


def published(sessions: Sessions, *, version: int) -> tuple[Any, list[logged.LoggedCall]]:
    """A published version, and the logged window its estimate was made on (its parent's: no
    traffic came and no claim set a call aside since)."""
    with sessions.begin() as session:
        row = policy.get(version, session=session)
        assert row is not None and row.retired_at is None, version
        calls = logged.window(
            session=session,
            lineage="policy",
            version=version - 1 if version > 1 else policy.BASE_VERSION,
            tenants=[],
            episodes=256,
        )
    return row, calls


def test_an_fsdp2_config_shards_the_base_and_what_is_not_done_is_refused() -> None:
    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    assert distributed.from_launcher({}) == {}
    assert distributed.from_launcher(fsdp) == {"shard_base": True}
    assert distributed.from_launcher(fsdp | {"FSDP_ACTIVATION_CHECKPOINTING": "true"}) == {
        "shard_base": True,
        "gradient_checkpointing": True,
    }
    refused = {
        "FSDP version 1.*fsdp2.yaml": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"},
        "DeepSpeed.*fsdp2.yaml": {"ACCELERATE_USE_DEEPSPEED": "true"},
        "FSDP_OFFLOAD_PARAMS=true": fsdp | {"FSDP_OFFLOAD_PARAMS": "true"},
        "FSDP_RESHARD_AFTER_FORWARD=false": fsdp | {"FSDP_RESHARD_AFTER_FORWARD": "false"},
    }
    for message, env in refused.items():
        with pytest.raises(SystemExit, match=message):
            distributed.from_launcher(env)


def test_sharding_the_base_alone_is_refused_naming_the_launchers(tmp_path: Path) -> None:
    settings = TrainerSettings(
        model=build_demo_model(TEST_HOME / "models" / "demo"),
        vllm=["http://127.0.0.1:9"],
        adapters_dir=tmp_path / "adapters",
        home=tmp_path,
        shard_base=True,
    )
    with pytest.raises(SystemExit, match="torchrun or accelerate launch"):
        turns.run(settings)
