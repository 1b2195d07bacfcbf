"""Several lineages' engines on one base model (issue 32, many lineages in one trainer): each
lineage trains exactly as it would alone, never moves another lineage's adapter, and saves an
adapter vLLM loads. The tiny demo model, real TRL and PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from tests.trainer.learner.test_engine import samples_for
from tests.trainer.learner.test_engine import settings as settings
from trainer.config import TrainerSettings
from trainer.learner.engine import Engine


def lora(engine: Engine) -> dict[str, torch.Tensor]:
    """The engine's adapter weights, by their saved names."""
    state = get_peft_model_state_dict(engine.model, adapter_name=engine.adapter)
    return {k: v.detach().clone() for k, v in state.items()}


def test_lineages_beside_each_other_train_as_each_would_alone(
    settings: TrainerSettings,
    tmp_path: Path,
) -> None:
    start = tmp_path / "start"
    first = Engine(settings)
    first.step(samples_for(first))  # a start where every LoRA weight is non-zero
    first.save_adapter(start)

    alone_a = Engine(settings, resume_from=start)
    alone_b = Engine(settings, resume_from=start)
    shared_a = Engine(settings, resume_from=start)
    shared_b = shared_a.beside(settings, "lineage1", start)
    batch_a = samples_for(alone_a)
    batch_b = list(reversed(samples_for(alone_b)))[:3]

    before_b = lora(shared_b)
    alone_a.step(batch_a)
    shared_a.step(batch_a)
    assert all(torch.equal(v, lora(shared_b)[k]) for k, v in before_b.items())  # untouched
    alone_b.step(batch_b)
    shared_b.step(batch_b)
    shared_a.step(batch_a)  # and once more each, interleaved: optimizer states stay apart
    alone_a.step(batch_a)
    shared_b.step(batch_b)
    alone_b.step(batch_b)
    for alone, shared in ((alone_a, shared_a), (alone_b, shared_b)):
        mine, theirs = lora(alone), lora(shared)
        assert mine.keys() == theirs.keys() and mine
        for k in mine:
            torch.testing.assert_close(theirs[k], mine[k], rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(*(next(iter(lora(e).values())) for e in (shared_a, shared_b)))

    # Each saves an adapter in vLLM's layout, with its own weights, and resumes from it.
    for engine in (shared_a, shared_b):
        out = tmp_path / f"saved-{engine.adapter}"
        engine.save_adapter(out)
        files = {p.name for p in out.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= files
        assert engine.adapter not in files  # vLLM reads the adapter from the folder itself
        weights = load_file(out / "adapter_model.safetensors")
        for k, v in lora(engine).items():
            torch.testing.assert_close(weights[k], v, rtol=0, atol=0)
        resumed = Engine(settings, resume_from=out)
        for k, v in lora(resumed).items():
            torch.testing.assert_close(v, lora(engine)[k], rtol=0, atol=0)


def test_following_another_version_moves_only_that_lineage(
    settings: TrainerSettings,
    tmp_path: Path,
) -> None:
    a = Engine(settings)
    b = a.beside(settings, "lineage1", None)
    a.step(samples_for(a))
    a.save_adapter(tmp_path / "a")
    kept = lora(a)
    b.load_adapter(tmp_path / "a")  # b takes over a's version's weights
    for k, v in kept.items():
        torch.testing.assert_close(lora(b)[k], v, rtol=0, atol=0)
    b.load_adapter(None)  # and back to the base model: its B matrices zero, a's untouched
    assert all(not v.any() for k, v in lora(b).items() if "lora_B" in k)
    for k, v in kept.items():
        torch.testing.assert_close(lora(a)[k], v, rtol=0, atol=0)


@pytest.mark.parametrize("adapter", ["default", "lineage3"])
def test_a_snapshot_restores_only_its_own_lineage(
    settings: TrainerSettings,
    adapter: str,
) -> None:
    a = Engine(settings)
    b = a.beside(settings, "lineage3", None)
    engine, other = (a, b) if adapter == "default" else (b, a)
    snap = engine.snapshot()
    kept = lora(engine)
    engine.step(samples_for(engine))
    other.step(samples_for(other))
    moved_other = lora(other)
    engine.restore(snap)
    for k, v in kept.items():
        torch.testing.assert_close(lora(engine)[k], v, rtol=0, atol=0)
    for k, v in moved_other.items():
        torch.testing.assert_close(lora(other)[k], v, rtol=0, atol=0)
