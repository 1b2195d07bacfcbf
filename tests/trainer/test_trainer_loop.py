"""The trainer loop on real Postgres and real TRL training, with the fake vLLM's adapter endpoints.

Transitions come in through the real proxy (the fake's token ids fit the demo model's vocabulary).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import text
from sqlalchemy.orm import Session

from core import policy, tenants
from core.database import Sessions
from core.vllm import AdapterRejected
from demo.tiny_model import build_demo_model
from demo.vllm_server import free_port
from fakes.vllm import FakeVLLM
from flywheel import status
from tests.conftest import TEST_HOME, RunningProxy
from trainer import gate
from trainer.config import TrainerSettings
from trainer.data import store
from trainer.loop import Trainer
from trainer.vllm import Replicas

pytestmark = pytest.mark.slow


def play(
    proxy: RunningProxy,
    tasks: int = 2,
    episodes_per_task: int = 4,
    agent: str = "a",
    key: str | None = None,
    flip: bool = False,
) -> None:
    """Episodes through the proxy, half of each task's episodes rewarded (`flip`: the others)."""
    with proxy.client(**({"Authorization": f"Bearer {key}"} if key else {})) as c:
        for t in range(tasks):
            for e in range(episodes_per_task):
                episode = f"{agent}-t{t}-e{e}"
                r = c.post(
                    "/v1/chat/completions",
                    headers={"X-Episode-Id": episode, "X-Task-Id": f"t{t}", "X-Agent-Name": agent},
                    json={
                        "model": "policy",
                        "messages": [{"role": "user", "content": f"q{t}"}],
                        "max_tokens": 4,
                    },
                )
                assert r.status_code == 200
                c.post("/v1/rewards", json={"episode_id": episode, "reward": float((e + flip) % 2)})


@pytest.fixture
def make_trainer(
    proxy: RunningProxy, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> Iterator[Any]:
    admins: list[Replicas] = []

    def make(**overrides: Any) -> Trainer:
        values: dict[str, Any] = {
            "model": build_demo_model(TEST_HOME / "models" / "demo"),
            "vllm": [fake_vllm.url],
            "adapters_dir": tmp_path / "adapters",
            "home": tmp_path,
            "database_url": proxy.database_url,
            "min_episodes": 4,
            "metrics_port": 0,
            "learning_rate": 1e-3,
            "retire_grace_s": 0,  # test_a_retired_version_waits_out_its_grace has its own
        }
        settings = TrainerSettings(**(values | overrides))
        admins.append(Replicas(settings.vllm, None))
        return Trainer(settings, sessions, admins[-1])

    yield make
    for admin in admins:
        admin.close()


def current(sessions: Sessions) -> policy.Adapter | None:
    with sessions.begin() as session:
        return policy.current(session=session)


def test_a_step_publishes_a_version_the_alias_follows(
    proxy: RunningProxy, fake_vllm: FakeVLLM, make_trainer: Any, sessions: Sessions
) -> None:
    play(proxy)
    trainer = make_trainer()
    assert trainer.step()
    adapter = current(sessions)
    assert adapter is not None and adapter.name == "policy-v1"
    assert fake_vllm.loras["policy-v1"] == adapter.path
    assert {p.name for p in Path(adapter.path).iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    rows = proxy.query("SELECT trained_version, count(*) FROM transition GROUP BY 1")
    assert rows == [(1, 8)]
    assert adapter.trained_transitions == 8 and adapter.stats and adapter.stats["samples"] == 8
    # The proxy's alias follows within a second.
    with proxy.client() as c:
        for _ in range(40):
            r = c.post(
                "/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
            )
            if r.headers["x-policy-version"] == "1":
                break
            threading.Event().wait(0.05)
    assert r.headers["x-policy-version"] == "1"
    assert fake_vllm.requests[-1]["body"]["model"] == "policy-v1"
    assert not trainer.step()  # nothing left to train


def test_selective_optimisation_trains_only_the_chosen_agents(
    proxy: RunningProxy, make_trainer: Any
) -> None:
    play(proxy, agent="planner")
    play(proxy, agent="solver")
    trainer = make_trainer(agents="solver")
    assert trainer.step()
    rows = proxy.query(
        "SELECT agent_name, count(*) FILTER (WHERE trained_at IS NOT NULL), count(*) "
        "FROM transition GROUP BY 1 ORDER BY 1"
    )
    assert rows == [("planner", 0, 8), ("solver", 8, 8)]


def test_a_trainer_per_lineage_trains_and_publishes_only_its_own(
    make_proxy: Any, fake_vllm: FakeVLLM, make_trainer: Any, sessions: Sessions
) -> None:
    """Issue 12: the writer and the rewriter each get an adapter of their own; the checker (no
    lineage of its own, and no trainer on the default one) stays on the base model."""
    lineages = make_proxy(adapter_per_agent="writer,rewriter")
    for agent in ("writer", "rewriter", "checker"):
        play(lineages, agent=agent)
    writer = make_trainer(lineage="writer", trainer_id="t-writer")
    rewriter = make_trainer(lineage="rewriter", trainer_id="t-rewriter", lease_s=0.5)
    assert writer.step() and rewriter.step()
    assert not writer.step() and not rewriter.step()  # each has trained all of its own
    with sessions.begin() as session:
        adapters = {a.name: a for a in policy.versions(session=session)}
        assert {k: a.name for k, a in policy.currents(session=session).items()} == {
            "writer": "writer-v1",
            "rewriter": "rewriter-v2",
        }
    assert set(adapters) == {"writer-v1", "rewriter-v2"} and set(fake_vllm.loras) == set(adapters)
    assert adapters["rewriter-v2"].stats["parent"] is None  # type: ignore[index]
    rows = lineages.query(
        "SELECT agent_name, lineage, trained_version, count(*) FROM transition "
        "GROUP BY 1, 2, 3 ORDER BY 1"
    )
    assert rows == [
        ("checker", "policy", None, 8),
        ("rewriter", "rewriter", 2, 8),
        ("writer", "writer", 1, 8),
    ]
    # Its own only: the rewriter's reconcile (once anything unrecorded of its own would be an
    # orphan, past its short lease) leaves the writer's adapter loaded and on disk.
    time.sleep(0.6)  # not a wait for something to happen: the lease (0.5 s) must have run out
    rewriter.reconcile()
    assert "writer-v1" in fake_vllm.loras and Path(adapters["writer-v1"].path).exists()


def test_the_trainer_can_be_restricted_to_tenants(
    make_proxy: Any, make_trainer: Any, sessions: Sessions
) -> None:
    # Both tenants on the shared lineages (their own would keep them apart already).
    proxy = make_proxy(auth="keys", keys_refresh_s=0.1, shared_lineages="*")
    keys = {}
    with sessions.begin() as session:
        for tenant in ("acme", "globex"):
            keys[tenant] = tenants.create_key(
                session=session, tenant=tenant, scopes=["infer", "reward"]
            )[1]
    proxy.wait_keys(*keys.values())
    for key in keys.values():
        play(proxy, key=key)
    trainer = make_trainer(tenants="globex")
    assert trainer.step()
    assert not trainer.step()  # acme's traffic is not this trainer's
    rows = proxy.query(
        "SELECT split_part(episode_id, '/', 1), count(trained_at) FROM transition "
        "GROUP BY 1 ORDER BY 1"
    )
    assert rows == [("acme", 0), ("globex", 8)]


def test_a_rejected_adapter_leaves_the_alias_where_it_was(
    proxy: RunningProxy, fake_vllm: FakeVLLM, make_trainer: Any, sessions: Sessions
) -> None:
    play(proxy)
    trainer = make_trainer()
    assert trainer.step()  # v1 (rank 8) is live
    play(proxy, agent="b")
    fake_vllm.max_lora_rank = 1  # now vLLM refuses rank-8 adapters
    weights = {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}
    with pytest.raises(AdapterRejected):  # for run() to back off: vLLM's doing, not the batch's
        trainer.step()
    adapter = current(sessions)
    assert adapter is not None and adapter.name == "policy-v1"
    assert set(fake_vllm.loras) == {"policy-v1"}
    # The batch is back in the queue uncharged, the weights are as before, no directory is left.
    assert proxy.query(
        "SELECT count(*), max(train_attempts) FROM transition WHERE agent_name = 'b' "
        "AND trained_at IS NULL AND claimed_by IS NULL"
    ) == [(8, 0)]
    for name, p in trainer.engine.model.named_parameters():
        assert (p == weights[name]).all(), name
    assert [d.name for d in trainer.settings.adapters_dir.iterdir()] == ["policy-v1"]
    fake_vllm.max_lora_rank = 8
    assert trainer.step()  # retried: now v3 (v2's number was spent on the refused one)
    assert current(sessions).name == "policy-v3"  # type: ignore[union-attr]


def test_old_versions_are_retired_marked_then_unloaded_then_deleted(
    proxy: RunningProxy, fake_vllm: FakeVLLM, make_trainer: Any, sessions: Sessions
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # a replica down: nothing may be deleted yet
    trainer = make_trainer(retain_versions=1, vllm=[fake_vllm.url, dead])
    for agent in ("a", "b"):
        play(proxy, agent=agent)
        assert trainer.step()
    with sessions() as session:
        adapters = policy.versions(session=session)
    assert [(a.name, a.retired_at is not None) for a in adapters] == [
        ("policy-v1", True),
        ("policy-v2", False),
    ]
    assert set(fake_vllm.loras) == {"policy-v2"}  # unloaded where it could be...
    dirs = sorted(d.name for d in trainer.settings.adapters_dir.iterdir())
    assert dirs == ["policy-v1", "policy-v2"]  # ...but kept: the dead replica may still read it
    trainer.vllm.urls = [fake_vllm.url]  # the dead replica is gone for good
    play(proxy, agent="c")
    assert trainer.step()
    dirs = sorted(d.name for d in trainer.settings.adapters_dir.iterdir())
    assert dirs == ["policy-v3"] and set(fake_vllm.loras) == {"policy-v3"}
    with sessions() as session:
        assert [a.version for a in policy.versions(session=session) if not a.retired_at] == [3]


def test_a_retired_version_waits_out_its_grace_before_it_is_unloaded_and_deleted(
    proxy: RunningProxy, fake_vllm: FakeVLLM, make_trainer: Any, sessions: Sessions
) -> None:
    """A call routed to v1 just before v2 replaced it may still sit in vLLM's queue, and vLLM
    loads a queued call's adapter from disk: deleted, its engine dies (seen in bench/canary)."""
    trainer = make_trainer(retain_versions=1, retire_grace_s=0.5)
    for agent in ("a", "b"):
        play(proxy, agent=agent)
        assert trainer.step()
    with sessions() as session:
        assert [a.retired_at is not None for a in policy.versions(session=session)] == [True, False]
    assert set(fake_vllm.loras) == {"policy-v1", "policy-v2"}  # retired, but still there
    assert (trainer.settings.adapters_dir / "policy-v1").exists()
    time.sleep(0.6)  # the grace (0.5 s) must have run out: time itself is the condition
    trainer.reconcile()  # the next reconcile after the grace
    assert set(fake_vllm.loras) == {"policy-v2"}
    assert not (trainer.settings.adapters_dir / "policy-v1").exists()


def test_retiring_never_deletes_a_directory_outside_the_adapters_dir(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions, tmp_path: Path
) -> None:
    """Issue 13, item 8: the path to delete comes from the database; it is checked first."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("x")
    trainer = make_trainer(retain_versions=1)
    play(proxy, agent="a")
    assert trainer.step()
    outside = trainer.settings.adapters_dir / ".." / "precious"  # resolves outside
    with sessions.begin() as session:
        session.execute(
            text("UPDATE adapter_version SET path = :p WHERE version = 1"), {"p": str(outside)}
        )
    play(proxy, agent="b")
    assert trainer.step()
    with sessions() as session:
        assert [a.retired_at is not None for a in policy.versions(session=session)] == [True, False]
    assert (precious / "keep").exists()


def test_a_killed_trainers_claim_is_taken_over_after_its_lease(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions
) -> None:
    play(proxy)
    with sessions.begin() as session:  # trainer "dead" claims the batch, then dies
        claimed = store.claim(
            session=session,
            trainer_id="dead",
            lease_s=1.0,
            lineage="policy",
            agents=[],
            tenants=[],
            limit=256,
            min_episodes=4,
            min_groups=1,
            max_attempts=3,
        )
    assert len(claimed) == 8
    survivor = make_trainer(lease_s=60)
    assert not survivor.step()  # the lease still holds
    threading.Event().wait(1.2)
    assert survivor.step()  # expired: taken over and trained
    with sessions.begin() as session, pytest.raises(store.LostClaim):
        store.finish(
            session=session,
            trainer_id="dead",
            trained={c.id: c.ret for c in claimed},
            skipped={},
            publication=store.Publication("policy", 99, 1, "/nowhere", "demo", {}),
        )
    assert proxy.query("SELECT count(*) FROM transition WHERE trained_version = 1") == [(8,)]


def test_two_trainers_at_once_never_train_the_same_transition(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions
) -> None:
    for agent in ("a", "b", "c"):
        play(proxy, agent=agent)
    trainers = [make_trainer(trainer_id=f"trainer-{i}", max_batch_transitions=8) for i in (1, 2)]
    published: dict[str, int] = {}

    def work(trainer: Trainer) -> None:
        while trainer.step():
            pass
        published[trainer.settings.trainer_id] = trainer.steps

    threads = [threading.Thread(target=work, args=(t,)) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(published.values()) == 3
    per_version = proxy.query(
        "SELECT trained_version, count(*) FROM transition GROUP BY 1 ORDER BY 1"
    )
    assert [n for _, n in per_version] == [8, 8, 8]
    with sessions.begin() as session:
        adapters = policy.versions(session=session)
    assert sorted(a.trained_transitions for a in adapters) == [8, 8, 8]
    assert len({a.name for a in adapters}) == 3
    # One lineage: each version was trained from the one before it (none from a sibling).
    parents = [a.stats["parent"] for a in adapters if a.stats]
    assert parents == [None] + [a.version for a in adapters[:-1]], parents


def test_vllm_restart_gets_the_current_adapter_back(
    proxy: RunningProxy, fake_vllm: FakeVLLM, make_trainer: Any
) -> None:
    play(proxy)
    trainer = make_trainer()
    assert trainer.step()
    fake_vllm.loras.clear()  # vLLM restarted: it has no adapters
    trainer.reconcile()
    assert "policy-v1" in fake_vllm.loras
    models = httpx.get(f"{proxy.v1}/models").json()["data"]
    assert "policy-v1" in {m["id"] for m in models}


def trainer_process(
    proxy: RunningProxy, fake: FakeVLLM, tmp_path: Path, *args: str, metrics_port: int = 0
) -> subprocess.Popen[str]:
    """`flywheel trainer` on the proxy's database and the fake vLLM, its output piped."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flywheel",
            "trainer",
            "--model",
            str(build_demo_model(TEST_HOME / "models" / "demo")),
            "--vllm",
            fake.url,
            "--adapters-dir",
            str(tmp_path / "adapters"),
            *args,
        ],
        env={
            **os.environ,
            "FLYWHEEL_DATABASE_URL": proxy.database_url,
            "FLYWHEEL_HOME": str(tmp_path),
            "FLYWHEEL_METRICS_PORT": str(metrics_port),
            "FLYWHEEL_MIN_EPISODES": "4",
            "FLYWHEEL_POLL_S": "0.2",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_flywheel_trainer_process_prints_progress_and_serves_metrics(
    proxy: RunningProxy, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    port = free_port()
    process = trainer_process(proxy, fake_vllm, tmp_path, "--max-steps", "1", metrics_port=port)
    try:
        # The metrics port opens once the engine is built; with no data yet, the trainer waits.
        scraped = ""
        deadline = time.monotonic() + 120
        while "flywheel_trainer_queue_transitions" not in scraped:
            assert process.poll() is None and time.monotonic() < deadline
            with contextlib.suppress(httpx.HTTPError):
                scraped = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            time.sleep(0.2)
        play(proxy)
        output = process.communicate(timeout=120)[0]
    finally:
        process.kill()
    assert process.returncode == 0, output
    # It may claim as soon as min_episodes (4) of play()'s 8 episodes are credited.
    assert re.search(r"step 1 -> v1 \| [4-8] samples, reward [0-9.]+ \| loss", output), output
    assert proxy.query("SELECT name FROM adapter_version WHERE is_current") == [("policy-v1",)]


def test_data_from_another_base_model_is_set_aside_not_fatal(
    proxy: RunningProxy, make_trainer: Any
) -> None:
    play(proxy)
    # One transition's ids come from a model with a bigger vocabulary (a previous base model):
    # its first token becomes 100000 (int32, little-endian as stored).
    proxy.query(
        "UPDATE transition SET completion_token_ids = "
        "decode('a0860100', 'hex') || substring(completion_token_ids from 5) "
        "WHERE id = (SELECT id FROM transition ORDER BY requested_at LIMIT 1) RETURNING id"
    )
    trainer = make_trainer()
    assert trainer.step()
    assert proxy.query(
        "SELECT skip_reason, count(*) FROM transition WHERE trained_at IS NULL GROUP BY 1"
    ) == [("token_out_of_vocab", 1)]


def test_concurrent_publishes_are_serialised_and_only_one_child_wins(sessions: Sessions) -> None:
    """Two trainers that started from one version: the second publish waits for the first, then
    is told the policy moved (it used to win too, forking the lineage)."""

    def publish(session: Session, version: int) -> None:
        store.finish(
            session=session,
            trainer_id=f"t{version}",
            trained={},
            skipped={},
            publication=store.Publication("policy", version, None, "/a", "demo", {}),
        )

    first = sessions()
    first.begin()
    publish(first, 101)  # not committed yet
    outcome: dict[str, object] = {}

    def second() -> None:
        try:
            with sessions.begin() as session:
                publish(session, 102)
            outcome["ok"] = True
        except Exception as e:  # reported below rather than lost in the thread
            outcome["error"] = e

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive()  # waits for the first publish to finish
    first.commit()
    first.close()
    thread.join(10)
    assert isinstance(outcome.get("error"), policy.PolicyMoved), outcome
    assert outcome["error"].current == 101  # type: ignore[attr-defined]
    assert current(sessions).name == "policy-v101"  # type: ignore[union-attr]


# --- issue 13, items 5-7: rollbacks stick, bad batches, rewards mid-step, SIGTERM ---------------


def lora_weights(adapter_dir: str) -> dict[str, torch.Tensor]:
    return load_file(Path(adapter_dir) / "adapter_model.safetensors")


def engine_lora(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The engine's LoRA weights under their saved names (PEFT drops the adapter name)."""
    return {
        n.replace(".default", ""): p.detach().clone()
        for n, p in trainer.engine.model.named_parameters()
        if "lora_" in n
    }


def test_a_rollback_sticks_the_next_step_trains_from_the_version_rolled_back_to(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions, monkeypatch: Any
) -> None:
    trainer = make_trainer()
    for agent in ("a", "b"):
        play(proxy, agent=agent)
        assert trainer.step()
    with sessions.begin() as session:  # what POST /admin/adapters/1/activate commits
        policy.make_current(1, session=session)
        v1 = policy.get(1, session=session)
    assert v1 is not None
    seen: dict[str, dict[str, torch.Tensor]] = {}
    real_step = trainer.engine.step

    def step(samples: Any) -> Any:
        seen["start"] = engine_lora(trainer)
        return real_step(samples)

    monkeypatch.setattr(trainer.engine, "step", step)
    play(proxy, agent="c")
    assert trainer.step()
    adapter = current(sessions)
    assert adapter is not None and adapter.version == 3
    assert adapter.stats and adapter.stats["parent"] == 1  # it descends from v1, not v2
    saved = lora_weights(v1.path)
    assert saved.keys() == seen["start"].keys()
    for name, weight in saved.items():
        assert torch.equal(weight, seen["start"][name]), name


def test_a_rollback_during_a_step_makes_the_trainer_train_its_batch_again_from_there(
    proxy: RunningProxy,
    fake_vllm: FakeVLLM,
    make_trainer: Any,
    sessions: Sessions,
    monkeypatch: Any,
) -> None:
    trainer = make_trainer()
    play(proxy, agent="a")
    assert trainer.step()  # v1
    play(proxy, agent="b")
    real_step, calls = trainer.engine.step, []

    def step(samples: Any) -> Any:
        calls.append(len(samples))
        if len(calls) == 1:  # an operator rolls back to the base model meanwhile
            with sessions.begin() as session:
                policy.make_current(None, session=session)
        return real_step(samples)

    monkeypatch.setattr(trainer.engine, "step", step)
    assert trainer.step()
    assert calls == [8, 8]  # trained twice: the first result was a child of v1
    adapter = current(sessions)
    assert adapter is not None and adapter.version == 3 and adapter.stats
    assert adapter.stats["parent"] is None
    assert "policy-v2" not in fake_vllm.loras  # the discarded child is unloaded and deleted
    assert not (trainer.settings.adapters_dir / "policy-v2").exists()
    assert proxy.query(
        "SELECT trained_version, count(*) FROM transition WHERE agent_name = 'b' GROUP BY 1"
    ) == [(3, 8)]


def test_a_batch_that_breaks_the_step_is_given_back_then_set_aside(
    proxy: RunningProxy, make_trainer: Any, monkeypatch: Any
) -> None:
    play(proxy, agent="bad")
    trainer = make_trainer(max_train_attempts=2)

    def broken(samples: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(trainer.engine, "step", broken)
    for attempt in (1, 2):
        assert not trainer.step()  # no exception escapes: the trainer lives on
        assert proxy.query(
            "SELECT count(*), max(train_attempts) FROM transition "
            "WHERE claimed_by IS NULL AND skip_reason IS NULL"
        ) == [(8, attempt)]
    monkeypatch.undo()
    play(proxy, agent="good")
    assert trainer.step()  # the bad batch is set aside, the next one trains
    rows = proxy.query(
        "SELECT agent_name, skip_reason, trained_version FROM transition "
        "GROUP BY 1, 2, 3 ORDER BY 1"
    )
    assert rows == [("bad", "train_failed", None), ("good", None, 1)]


def test_a_batch_whose_trainers_kept_crashing_is_set_aside(
    proxy: RunningProxy, make_trainer: Any
) -> None:
    """A trainer that dies mid-step leaves its claim to expire, still naming it: rows at their
    last attempt were skipped over but never set aside (only unclaimed ones were), so they stayed
    at the head of the queue for good."""
    play(proxy, agent="bad")
    proxy.query(
        "UPDATE transition SET claimed_by = 'crashed', train_attempts = 3, "
        "claim_expires_at = now() - interval '1 second' RETURNING id"
    )
    play(proxy, agent="good")
    trainer = make_trainer()  # max_train_attempts: 3
    assert trainer.step()
    rows = proxy.query(
        "SELECT agent_name, skip_reason, claimed_by, trained_version FROM transition "
        "GROUP BY 1, 2, 3, 4 ORDER BY 1"
    )
    assert rows == [("bad", "train_failed", None, None), ("good", None, None, 1)]


def test_a_reward_that_moves_a_claimed_return_makes_the_trainer_train_it_again(
    proxy: RunningProxy, make_trainer: Any, monkeypatch: Any
) -> None:
    """Issue 13, item 6: the trainer trained on the old return and marked it trained."""
    play(proxy)
    trainer = make_trainer()
    real_step = trainer.engine.step

    def step(samples: Any) -> Any:
        if not hasattr(step, "done"):  # the application corrects a reward mid-step
            step.done = True  # type: ignore[attr-defined]
            with proxy.client() as c:
                r = c.post("/v1/rewards", json={"episode_id": "a-t0-e0", "reward": 0.75})
            assert r.status_code == 200, r.text
        return real_step(samples)

    monkeypatch.setattr(trainer.engine, "step", step)
    assert not trainer.step()  # lost: a return moved under it
    assert proxy.query("SELECT count(*) FROM transition WHERE claimed_by IS NOT NULL") == [(0,)]
    assert trainer.step()
    assert proxy.query(
        "SELECT trained_version, \"return\" FROM transition WHERE episode_id = 'a-t0-e0'"
    ) == [(2, 0.75)]


def test_sigterm_gives_the_claims_back_at_once(
    proxy: RunningProxy, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    """Issue 13, item 7: a restarted trainer left its batch locked for the whole lease."""
    play(proxy)
    fake_vllm.load_delay_s = 60  # the step is published slowly: SIGTERM lands mid-publish
    process = trainer_process(proxy, fake_vllm, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "adapters").glob("policy-v*")):  # trained, now loading
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert proxy.query("SELECT count(*) FROM transition WHERE claimed_by IS NOT NULL") == [(8,)]
        process.terminate()
        output = process.communicate(timeout=30)[0]
    finally:
        process.kill()
        fake_vllm.load_delay_s = 0  # ends the fake's wait for the killed trainer's load
    assert process.returncode == 0, output
    assert "gave back 8 claimed transitions" in output, output
    assert proxy.query(
        "SELECT count(*), max(train_attempts) FROM transition "
        "WHERE claimed_by IS NULL AND trained_at IS NULL"
    ) == [(8, 0)]


def test_sigterm_mid_vllm_call_leaves_no_task_to_run_later(fake_vllm: FakeVLLM) -> None:
    """A SIGTERM during a load left load_everywhere pending in the trainer's private loop; it
    ran on at the next use of that loop (closing it) and failed there, unretrieved."""
    fake_vllm.load_delay_s = 60
    replicas = Replicas([fake_vllm.url], None)

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # what the trainer's SIGTERM handler does (with Stopping)

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            replicas.load_everywhere("policy-v1", "/nowhere")
    finally:
        signal.signal(signal.SIGALRM, previous)
        fake_vllm.load_delay_s = 0
    assert asyncio.all_tasks(replicas._loop) == set()
    replicas.close()


def sampled_calls(
    proxy: RunningProxy, prefix: str, sampling: dict[str, Any], *, rewarded: bool = True
) -> list[str]:
    """Two tasks of two episodes each, sampled with `sampling`, rewarded at once (or not)."""
    episodes = []
    with proxy.client() as c:
        for t in range(2):
            for e in range(2):
                episode = f"{prefix}-t{t}-e{e}"
                r = c.post(
                    "/v1/chat/completions",
                    headers={"X-Episode-Id": episode, "X-Task-Id": f"{prefix}{t}"},
                    json={
                        "model": "policy",
                        "messages": [{"role": "user", "content": f"q{t}"}],
                        "max_tokens": 4,
                        **sampling,
                    },
                )
                assert r.status_code == 200
                if rewarded:
                    c.post("/v1/rewards", json={"episode_id": episode, "reward": float(e)})
                episodes.append(episode)
    return episodes


def test_calls_at_any_temperature_and_truncation_are_trained_greedy_ones_set_aside(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions
) -> None:
    """What applications send (issue 30): before, only temperature 1.0 without top-p/top-k was
    trained (`other_temperature`, `truncated_sampling`)."""
    sampled_calls(proxy, "warm", {"temperature": 0.7})
    sampled_calls(proxy, "nucleus", {"temperature": 0.5, "top_p": 0.9, "top_k": 20})
    sampled_calls(proxy, "greedy", {"temperature": 0})
    sampled_calls(proxy, "json", {"response_format": {"type": "json_object"}})
    trainer = make_trainer(min_episodes=4)
    assert trainer.step()
    rows = proxy.query(
        "SELECT split_part(episode_id, '-', 1), trained_version, skip_reason, count(*) "
        "FROM transition GROUP BY 1, 2, 3 ORDER BY 1"
    )
    assert rows == [
        ("greedy", None, "greedy", 4),
        ("json", None, "constrained_decoding", 4),
        ("nucleus", 1, None, 4),
        ("warm", 1, None, 4),
    ]
    # What an operator reads (flywheel status): the share, and why the rest is not trained.
    screen = status.render(status.collect(sessions))
    assert "became training data: 8 (50% of the 16 decided)" in screen
    assert "4 calls at temperature 0: greedy calls carry no exploration" in screen
    assert "4 calls decoded to a grammar by vLLM: response_format" in screen
    assert re.search(r"^policy +v1 +- +- +0 +- +v1 ", screen, re.MULTILINE), screen


def test_a_reward_many_versions_late_is_still_trained(
    proxy: RunningProxy, make_trainer: Any
) -> None:
    """No cliff at four versions: episodes served by the base model and rewarded only after
    six versions were published are trained by the next step (their tokens weighted by how
    far the policy moved, trainer/learner/correction.py)."""
    late = sampled_calls(proxy, "late", {}, rewarded=False)
    served = "SELECT 1 FROM transition WHERE episode_id LIKE 'late-%%' AND policy_version = 0"
    assert len(proxy.wait_rows(served, 4)) == 4  # by the base model
    trainer = make_trainer(min_episodes=4)
    for step in range(6):
        play(proxy, agent=f"round{step}")
        assert trainer.step()
    with proxy.client() as c:
        for i, episode in enumerate(late):
            c.post("/v1/rewards", json={"episode_id": episode, "reward": float(i % 2)})
    assert trainer.step()
    rows = proxy.query(
        "SELECT trained_version, skip_reason, count(*) FROM transition "
        "WHERE episode_id LIKE 'late-%%' GROUP BY 1, 2"
    )
    assert rows == [(7, None, 4)]
    [(stats,)] = proxy.query("SELECT stats FROM adapter_version WHERE version = 7")
    assert stats["by_staleness"]["5-16"]["tokens"] > 0  # six versions between sampling and step


def test_an_orphans_directory_stays_while_a_replica_may_still_hold_it(
    proxy: RunningProxy, fake_vllm: FakeVLLM, make_trainer: Any, tmp_path: Path
) -> None:
    """vLLM reads an adapter's directory whenever it pages the adapter in again, and a missing
    directory crashes its engine: an unrecorded adapter's directory is deleted only once every
    replica answered (and unloaded it)."""
    orphan = tmp_path / "adapters" / "policy-v999"
    orphan.mkdir(parents=True)
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))  # long past any lease
    fake_vllm.loras[orphan.name] = str(orphan)
    down = f"http://127.0.0.1:{free_port()}"  # a replica that does not answer now
    make_trainer(vllm=[fake_vllm.url, down]).reconcile()
    assert orphan.name not in fake_vllm.loras  # unloaded where it could be
    assert orphan.exists()  # but the replica that did not answer may still have it
    make_trainer().reconcile()  # every replica answers
    assert not orphan.exists()


def test_held_out_episodes_are_never_trained_and_each_version_is_estimated_on_them(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions
) -> None:
    """FLYWHEEL_OPE (trainer/candidate.py): a share of episodes, by a hash of their id, is set
    aside as `ope_holdout` and never trained; each new version is estimated on them against the
    current one, the calls an older version served scored under the current version's weights
    (the fake vLLM's logprobs are not the model's: this is about which rows, not the values)."""
    share = 0.3
    play(proxy, tasks=4, episodes_per_task=8, agent="a")
    trainer = make_trainer(ope="log", ope_holdout=share, ope_min_ess=1, ope_resamples=20)
    assert trainer.step()  # v1, from the base model: its held-out episodes, served by the base
    first = {f"a-t{t}-e{e}" for t in range(4) for e in range(8)}
    held = {e for e in first if store.held_out(e, share)}
    assert 0 < len(held) < len(first)
    rows = proxy.query("SELECT episode_id, skip_reason, trained_version FROM transition")
    assert {(e, r, v) for e, r, v in rows} == {
        (e, "ope_holdout", None) if e in held else (e, None, 1) for e in first
    }
    v1 = current(sessions)
    assert v1 is not None and v1.stats is not None
    assert v1.stats["ope"]["episodes"] == len(held) and v1.stats["ope"]["rescored"] == 0

    play(proxy, tasks=4, episodes_per_task=8, agent="b")  # served by v1
    assert trainer.step()  # v2: both sets of held-out episodes, v1's own and the base's
    second = {f"b-t{t}-e{e}" for t in range(4) for e in range(8)}
    held_b = {e for e in second if store.held_out(e, share)}
    v2 = current(sessions)
    assert v2 is not None and v2.stats is not None and v2.version == 2
    ope = v2.stats["ope"]
    assert ope["episodes"] == len(held) + len(held_b), ope
    assert ope["rescored"] == len(held), ope  # the base's calls, under v1's weights
    assert ope["reused"] == len(held), ope  # ... as v1 scored them when it was the candidate
    assert ope["current"]["value"] is not None and ope["candidate"]["value"] is not None
    trained = proxy.query("SELECT count(*) FROM transition WHERE trained_version IS NOT NULL")
    assert trained == [(64 - len(held) - len(held_b),)]
    screen = status.render(status.collect(sessions))
    assert f"{len(held) + len(held_b)} calls kept out of training to estimate" in screen
    assert f"], {ope['episodes']} episodes)" in screen


def test_a_version_the_gate_fails_is_retired_unserved_and_training_goes_on_from_the_current(
    proxy: RunningProxy,
    fake_vllm: FakeVLLM,
    make_trainer: Any,
    sessions: Sessions,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FLYWHEEL_GATE=ope (trainer/gate.py decides, tests/trainer/test_gate.py): a failed version is
    recorded retired with the gate's reason, never served, its batch spent; the
    engine's weights go back to the current version's and the next version is trained from
    there (with FLYWHEEL_GATE_OVERLAP it was loaded, under no alias, while the estimate was made,
    and is unloaded again: tests/flywheel/test_evals.py). The verdicts are chosen here: this is
    about what the trainer does with them."""
    verdicts = iter([gate.Verdict("fail", "estimated worse"), gate.Verdict("pass", "not worse")])
    monkeypatch.setattr(gate, "decide", lambda *a, **k: next(verdicts))
    play(proxy, agent="a")
    trainer = make_trainer(gate="ope", ope_holdout=0)
    before = {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}
    assert not trainer.step()  # v1: failed
    with sessions.begin() as session:
        v1 = policy.get(1, session=session)
        assert policy.current(session=session) is None
    assert v1 is not None and v1.retired_at is not None and not v1.is_current
    assert v1.stats and v1.stats["gate"] == {"outcome": "fail", "reason": "estimated worse"}
    assert "policy-v1" not in fake_vllm.loras
    assert "gate fail: estimated worse" in status.render(status.collect(sessions))
    assert proxy.query("SELECT trained_version, count(*) FROM transition GROUP BY 1") == [(1, 8)]
    for name, p in trainer.engine.model.named_parameters():  # back on the base model's
        assert torch.equal(p, before[name]), name

    play(proxy, agent="b")
    assert trainer.step()  # v2: passed, from the base model (its parent), served
    with sessions.begin() as session:
        v2 = policy.current(session=session)
    assert v2 is not None and v2.version == 2 and v2.stats is not None
    assert v2.stats["parent"] is None and v2.stats["gate"]["outcome"] == "pass"
    assert "policy-v2" in fake_vllm.loras
