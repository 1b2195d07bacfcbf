"""Many lineages in one trainer process (issue 32): a Trainer per lineage over one base model,
stepped in turn; each publishes its own versions from its own lineage's transitions only.
Real Postgres, real TRL training, the proxy in front of the fake vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from core import policy
from core.database import Sessions
from demo.tiny_model import build_demo_model
from fakes.vllm import FakeVLLM
from tests.conftest import TEST_HOME, RunningProxy
from tests.core.test_tenants import new_key
from tests.trainer.test_trainer_loop import play
from trainer.config import TrainerSettings
from trainer.turns import Turns
from trainer.vllm import Replicas

pytestmark = pytest.mark.slow


def settings_for(proxy: RunningProxy, fake_vllm: FakeVLLM, tmp_path: Path, **more: Any) -> Any:
    return TrainerSettings(
        model=build_demo_model(TEST_HOME / "models" / "demo"),
        vllm=[fake_vllm.url],
        adapters_dir=tmp_path / "adapters",
        home=tmp_path,
        database_url=proxy.database_url,
        min_episodes=4,
        learning_rate=1e-3,
        **more,
    )


def test_one_process_trains_and_publishes_each_lineage_from_its_own_calls(
    make_proxy: Any, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> None:
    proxy = make_proxy(adapter_per_agent="writer,rewriter")
    play(proxy, agent="writer", tasks=4)  # two batches' worth
    play(proxy, agent="rewriter", flip=True)  # the same calls, the opposite rewards
    settings = settings_for(
        proxy, fake_vllm, tmp_path, lineages="writer,rewriter", max_steps=1, max_batch_transitions=8
    )
    vllm = Replicas(settings.vllm, None)
    try:
        turns = Turns(settings, sessions, vllm)
        trainers = turns.trainers
        assert [t.lineage for t in trainers] == ["writer", "rewriter"]
        assert trainers[1].engine.model is trainers[0].engine.model  # one base model
        turns.run()
    finally:
        vllm.close()

    with sessions.begin() as session:
        published = {
            lineage: policy.current(session=session, lineage=lineage)
            for lineage in ("writer", "rewriter")
        }
    assert all(published.values())
    writer, rewriter = published["writer"], published["rewriter"]
    assert writer and rewriter and writer.name.startswith("writer-v")
    assert rewriter.name.startswith("rewriter-v")
    assert {writer.name, rewriter.name} <= set(fake_vllm.loras)
    # One step each (the writer's second batch waits its turn), from its own lineage's calls.
    trained = proxy.query(
        "SELECT t.lineage, a.lineage, count(*) FROM transition t "
        "JOIN adapter_version a ON a.version = t.trained_version GROUP BY 1, 2 ORDER BY 1"
    )
    assert trained == [("rewriter", "rewriter", 8), ("writer", "writer", 8)]
    assert proxy.query(
        "SELECT count(*) FROM transition WHERE lineage = 'writer' AND trained_at IS NULL"
    ) == [(8,)]
    a, b = (load_file(Path(x.path) / "adapter_model.safetensors") for x in (writer, rewriter))
    assert a.keys() == b.keys()
    # two adapters, trained apart: opposite advantages on the same tokens, opposite first steps
    lora_b = [k for k in a if "lora_B" in k and a[k].abs().max() > 0]
    assert lora_b and all(torch.allclose(a[k], -b[k], atol=1e-6) for k in lora_b)


def test_lineages_are_checked_like_lineage(
    proxy: RunningProxy, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    with pytest.raises(ValidationError, match="not a lineage name"):
        settings_for(proxy, fake_vllm, tmp_path, lineages="writer,a/b")
    with pytest.raises(ValidationError, match="named twice"):
        settings_for(proxy, fake_vllm, tmp_path, lineages="writer,writer")
    with pytest.raises(ValidationError, match="tenant 'acme''s"):
        settings_for(proxy, fake_vllm, tmp_path, lineages="acme.policy,policy", tenants="globex")
    settings = settings_for(proxy, fake_vllm, tmp_path, lineages="acme.policy,policy")
    assert [(s.lineage, s.tenants) for s in settings.trained_lineages()] == [
        ("acme.policy", ["acme"]),
        ("policy", []),
    ]


def test_a_pattern_takes_in_every_tenants_lineage_as_it_appears(
    make_proxy: Any, fake_vllm: FakeVLLM, sessions: Sessions, tmp_path: Path
) -> None:
    proxy = make_proxy(auth="keys", api_keys="sk-default", keys_refresh_s=0.1)
    keys = [new_key(sessions, tenant) for tenant in ("acme", "globex")]
    proxy.wait_keys(*keys)
    play(proxy, key=keys[0])
    play(proxy, key="sk-default")  # the default tenant's `policy`: not `*.policy`
    settings = settings_for(
        proxy, fake_vllm, tmp_path, lineages="*.policy", max_steps=1, lineage_discover_s=0.1
    )
    vllm = Replicas(settings.vllm, None)
    try:
        turns = Turns(settings, sessions, vllm)
        assert [t.lineage for t in turns.trainers] == ["acme.policy"]
        play(proxy, key=keys[1])  # globex appears after the trainer started
        assert [t.lineage for t in turns.discover()] == ["globex.policy"]
        assert turns.discover() == []
        turns.run()
    finally:
        vllm.close()
    trained = proxy.query(
        "SELECT split_part(t.episode_id, '/', 1), a.lineage, count(*) FROM transition t "
        "JOIN adapter_version a ON a.version = t.trained_version GROUP BY 1, 2 ORDER BY 1"
    )
    assert trained == [("acme", "acme.policy", 8), ("globex", "globex.policy", 8)]
    assert proxy.query("SELECT count(*) FROM transition WHERE trained_at IS NULL") == [(8,)]
    assert turns.trainers[1].engine.model is turns.trainers[0].engine.model
