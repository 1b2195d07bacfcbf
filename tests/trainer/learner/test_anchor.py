"""The KL's reference (trainer/learner/anchor.py) on the tiny model: the policy GRPO started from
(`kl_anchor=start`) or the base model, kept with each version and held across a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.learner.test_engine import samples_for
from tests.trainer.learner.test_microbatch import settings_for
from trainer.config import TrainerSettings
from trainer.learner.anchor import FILE
from trainer.learner.engine import Engine
from trainer.learner.sft import Demo


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> TrainerSettings:
    return settings_for(tmp_path_factory.mktemp("anchor"))


DEMOS = [Demo([1, 30, 31, 32], [100, 101, 102]), Demo([1, 40, 41], [110, 111, 2])]


def warm(settings: TrainerSettings, **overrides: object) -> Engine:
    """An engine whose adapter two supervised steps moved away from the base model."""
    update = {"beta": 0.5, "sft_learning_rate": 5e-3} | overrides
    engine = Engine(settings.model_copy(update=update))
    for _ in range(2):
        engine.sft_step(DEMOS)
    return engine


def lora(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora_" in n}


def test_the_kl_is_taken_from_the_warm_start_not_the_base(settings: TrainerSettings) -> None:
    start = warm(settings)
    first = start.step(samples_for(start))  # the policy is its anchor: no divergence yet
    assert first.kl == pytest.approx(0.0, abs=1e-6)
    second = start.step(samples_for(start))  # one GRPO step from it
    assert second.kl is not None and second.kl > 1e-6
    base = warm(settings, kl_anchor="base")
    held_to_base = base.step(samples_for(base))  # the same weights, measured from the base
    assert held_to_base.kl is not None and held_to_base.kl > 1e-3
    # The anchor's pass (in the batch's preparation) puts the policy's weights back.
    now = lora(start)
    start.trainer.prepare([vars(s) | {"prompt": ""} for s in samples_for(start)])
    assert all(torch.equal(p, now[n]) for n, p in lora(start).items())
    assert not all(torch.equal(start.anchor.weights[n], p) for n, p in now.items())


def test_a_version_keeps_its_anchor_through_a_restart_and_a_rollback(
    settings: TrainerSettings, tmp_path: Path
) -> None:
    engine = warm(settings)
    anchor = dict(engine.anchor.weights) if engine.anchor else {}
    engine.step(samples_for(engine))
    engine.save_adapter(tmp_path / "v3")
    assert (tmp_path / "v3" / FILE).exists()
    resumed = Engine(engine.trainer.settings, resume_from=tmp_path / "v3")
    assert resumed.anchor is not None
    assert all(torch.equal(resumed.anchor.weights[n], w) for n, w in anchor.items())
    # A rollback: the engine takes over the version and its anchor, not the version's weights.
    engine.step(samples_for(engine))
    engine.sft_step(DEMOS)  # the anchor moves with a supervised step...
    assert engine.anchor is not None
    assert not all(torch.equal(engine.anchor.weights[n], w) for n, w in anchor.items())
    engine.load_adapter(tmp_path / "v3")  # ...and comes back with the version
    assert all(torch.equal(engine.anchor.weights[n], w) for n, w in anchor.items())
    # A version with no anchor kept (imported, or made with beta 0) is its own.
    (tmp_path / "v3" / FILE).unlink()
    engine.load_adapter(tmp_path / "v3")
    assert all(torch.equal(engine.anchor.weights[n], w) for n, w in lora(engine).items())


def test_an_undone_step_gives_the_anchor_back(settings: TrainerSettings) -> None:
    engine = warm(settings)
    assert engine.anchor is not None
    before, anchor = engine.snapshot(), dict(engine.anchor.weights)
    engine.sft_step(DEMOS)  # a supervised step that could not be published
    engine.restore(before)
    assert all(torch.equal(engine.anchor.weights[n], w) for n, w in anchor.items())


def test_no_anchor_is_kept_without_a_kl_term_or_when_it_is_the_base(
    settings: TrainerSettings, tmp_path: Path
) -> None:
    for engine in (Engine(settings), warm(settings, kl_anchor="base")):
        assert engine.anchor is None
        engine.save_adapter(tmp_path / engine.trainer.settings.kl_anchor)
        assert not (tmp_path / engine.trainer.settings.kl_anchor / FILE).exists()
    # TRL's own "ref" adapter (a copy of a resumed adapter) is never made: the base is the base.
    resumed = Engine(
        settings.model_copy(update={"beta": 0.5, "kl_anchor": "base"}),
        resume_from=tmp_path / "base",
    )
    assert "ref" not in resumed.model.peft_config
    assert (resumed.step(samples_for(resumed)).kl or 0.0) > 1e-6
