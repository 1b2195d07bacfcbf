"""Supervised steps on demonstrations (issue 41): posted through the real proxy, trained by the
real trainer (TRL/PEFT engine, the demo model), published and loaded like GRPO versions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from core import policy
from core.database import Sessions
from demo.tiny_model import build_demo_model
from fakes.vllm import FakeVLLM
from flywheel import status
from tests.conftest import TEST_HOME, RunningProxy
from tests.trainer.test_trainer_loop import play
from trainer.config import TrainerSettings
from trainer.data.demonstrations import ClaimedDemonstration
from trainer.learner import sft
from trainer.loop import Trainer
from trainer.vllm import Replicas

pytestmark = pytest.mark.slow

QUESTIONS = [f"what is {a} plus {b}" for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]


def demonstrations(n: int = 4, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "completion": f"the answer is {i}",
            **extra,
        }
        for i in range(n)
    ]


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
            "sft_learning_rate": 3e-3,
            "retire_grace_s": 0,
        }
        settings = TrainerSettings(**(values | overrides))
        admins.append(Replicas(settings.vllm, None))
        return Trainer(settings, sessions, admins[-1])

    yield make
    for admin in admins:
        admin.close()


def post(proxy: RunningProxy, body: Any) -> None:
    r = proxy.client().post("/v1/demonstrations", json=body)
    assert r.status_code == 200, r.text


def nll(trainer: Trainer, demos: list[sft.Demo]) -> float:
    """Mean negative log-likelihood of the answers' tokens under the engine's weights now."""
    model = trainer.engine.model
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for d in demos:
            ids = torch.tensor([d.prompt_ids + d.completion_ids])
            logits = model(input_ids=ids).logits[0, len(d.prompt_ids) - 1 : -1]
            logp = torch.log_softmax(logits.float(), -1)
            total -= logp[range(len(d.completion_ids)), d.completion_ids].sum().item()
            tokens += len(d.completion_ids)
    return total / tokens


def rendered(trainer: Trainer, proxy: RunningProxy) -> list[sft.Demo]:
    rows = proxy.query("SELECT id::text, messages, tools, completion FROM demonstration")
    claimed = [ClaimedDemonstration(i, 0, m, t, c, None, None) for i, m, t, c in rows]
    out = sft.render(claimed, trainer.engine.tokenizer, trainer.stops, trainer.engine.limits)
    assert not out.skipped
    return list(out.demos.values())


def versions(sessions: Sessions) -> list[policy.Adapter]:
    with sessions.begin() as session:
        return policy.versions(session=session)


def test_demonstration_steps_publish_versions_that_imitate_better(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions, fake_vllm: FakeVLLM
) -> None:
    post(proxy, demonstrations(8))
    trainer = make_trainer(sft_epochs=3, sft_batch=8)
    demos = rendered(trainer, proxy)
    losses = [nll(trainer, demos)]
    for _ in range(3):
        assert trainer.step()
        losses.append(nll(trainer, demos))
    assert not trainer.step()  # three epochs done: nothing is due
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.5, losses
    published = versions(sessions)
    assert [a.name for a in published] == ["policy-v1", "policy-v2", "policy-v3"]
    assert all(a.stats and a.stats["kind"] == "sft" for a in published)
    assert [a.stats["demonstrations"] for a in published if a.stats] == [8, 8, 8]
    assert "policy-v3" in fake_vllm.loras
    assert proxy.query("SELECT DISTINCT epochs, trained_version FROM demonstration") == [(3, 3)]
    # Every demonstration's answer ends where the model is stopped (its end-of-turn token).
    assert all(d.completion_ids[-1] in trainer.stops for d in demos)
    # What an operator reads: the supervised steps, and no demonstration left untrained.
    screen = status.render(status.collect(sessions))
    assert "policy-v3" in screen and "supervised: 8 demonstrations" in screen
    assert status.as_json(status.collect(sessions))["lineages"][0]["demonstrations"] == {
        "never_trained": 0,
        "all": 8,
    }


def test_first_trains_the_demonstrations_before_any_grpo_step(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions
) -> None:
    play(proxy)  # transitions credited and waiting
    post(proxy, demonstrations(6))
    trainer = make_trainer(sft_batch=4)  # demonstrations="first" is the default
    assert trainer.step() and trainer.step() and trainer.step()
    kinds = [a.stats["kind"] for a in versions(sessions) if a.stats]
    assert kinds == ["sft", "sft", "grpo"]  # 4 + 2 demonstrations, then the transitions
    assert proxy.query("SELECT count(*) FROM transition WHERE trained_version = 3") == [(8,)]


@pytest.mark.parametrize("anchor", ["start", "base"])
def test_grpo_after_a_warm_start_is_held_to_the_warm_start(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions, anchor: str
) -> None:
    """FLYWHEEL_BETA > 0 (trainer/learner/anchor.py): the first GRPO step's KL is measured from
    the policy the demonstrations made (zero: the policy is still it), not from the base model,
    unless FLYWHEEL_KL_ANCHOR says base; the version keeps its anchor for a restart."""
    play(proxy)
    post(proxy, demonstrations(4))
    trainer = make_trainer(sft_batch=4, beta=0.1, kl_anchor=anchor)
    assert trainer.step() and trainer.step()
    warm, grpo = versions(sessions)
    assert (
        warm.stats and warm.stats["kind"] == "sft" and grpo.stats and grpo.stats["kind"] == "grpo"
    )
    if anchor == "start":
        assert grpo.stats["kl"] == pytest.approx(0.0, abs=1e-6)
        assert (Path(grpo.path) / "anchor.safetensors").exists()
    else:
        assert grpo.stats["kl"] > 1e-5
        assert not (Path(grpo.path) / "anchor.safetensors").exists()


def test_mix_takes_a_step_of_each_kind_in_turn(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions
) -> None:
    post(proxy, demonstrations(4))
    play(proxy)
    trainer = make_trainer(demonstrations="mix")
    assert trainer.step()
    assert [a.stats["kind"] for a in versions(sessions) if a.stats] == ["sft", "grpo"]
    assert trainer.steps == 2
    off = make_trainer(demonstrations="off", trainer_id="another", lineage="policy")
    post(proxy, demonstrations(4, task_id="more"))
    assert not off.step()  # nothing but demonstrations waiting, and it takes none


def test_an_episodes_calls_train_by_their_token_ids(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions
) -> None:
    play(proxy, tasks=1, episodes_per_task=1)
    post(proxy, {"from_episode": "a-t0-e0"})
    trainer = make_trainer(min_episodes=100)  # no GRPO step: too few episodes
    assert trainer.step()
    [adapter] = versions(sessions)
    assert adapter.stats and adapter.stats["kind"] == "sft" and adapter.stats["demonstrations"] == 1
    [(tokens,)] = proxy.query("SELECT completion_tokens FROM transition")
    assert adapter.stats["tokens"] == tokens


def test_a_demonstration_that_cannot_be_trained_is_set_aside_with_its_reason(
    proxy: RunningProxy, make_trainer: Any, sessions: Sessions
) -> None:
    long = "word " * 2000  # beyond the demo model's context
    post(
        proxy,
        [*demonstrations(2), {"messages": [{"role": "user", "content": long}], "completion": "x"}],
    )
    trainer = make_trainer()
    assert trainer.step()
    assert proxy.query("SELECT skip_reason, epochs FROM demonstration ORDER BY skip_reason") == [
        ("too_long", 0),
        (None, 1),
        (None, 1),
    ]


def test_micro_batches_add_up_to_the_whole_batchs_gradient() -> None:
    model_dir = build_demo_model(TEST_HOME / "models" / "demo")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    preamble = [7, 8, 9, 10, 11, 12]  # a system prompt every demonstration starts with
    demos = [
        sft.Demo(preamble + list(range(3 + p, 3 + 2 * p)), list(range(40, 40 + c)))
        for p, c in [(9, 3), (4, 7), (12, 2), (5, 5)]
    ]
    grads = []
    for budget, share in ((0, False), (20, False), (0, True)):
        model.zero_grad()
        total = sft.completion_tokens(demos)
        loss = sft.backward(
            model,
            demos,
            budget=budget,
            pad_id=0,
            device=torch.device("cpu"),
            total=total,
            share=share,
        )
        grads.append(
            (loss, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        )
    (whole, g_whole), *others = grads
    for loss, g in others:  # in pieces, and with the prompts' shared prefix forwarded once
        assert abs(whole - loss) < 1e-5
        torch.testing.assert_close(g, g_whole, rtol=1e-4, atol=1e-6)
