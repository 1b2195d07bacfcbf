"""The TRL-backed engine on the tiny model: what one step changes, and importance sampling."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from demo.tiny_model import build_demo_model
from tests.conftest import TEST_HOME
from trainer.config import TrainerSettings
from trainer.data.sampling import Sampling
from trainer.learner.engine import Engine, Sample


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> TrainerSettings:
    model = build_demo_model(TEST_HOME / "models" / "demo")
    home = tmp_path_factory.mktemp("trainer")
    return TrainerSettings(
        model=model,
        vllm=["http://127.0.0.1:9"],
        adapters_dir=home / "adapters",
        home=home,
        learning_rate=5e-3,
    )


def behaviour_logprobs(engine: Engine, prompt: list[int], completion: list[int]) -> list[float]:
    """What vLLM would report for these tokens if it served the engine's current weights."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    logps = torch.log_softmax(logits.float(), dim=-1)
    return logps.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def samples_for(engine: Engine) -> list[Sample]:
    prompts = [[1, 30, 31, 32], [1, 40, 41], [1, 50, 51, 52, 53], [1, 60]]
    completions = [[100, 101, 102], [110, 111], [120, 121, 122, 123], [130, 2]]
    return [
        Sample(
            prompt_ids=p,
            completion_ids=c,
            logprobs=behaviour_logprobs(engine, p, c),
            advantage=a,
            reward=a,
            sampling=Sampling(),
            staleness=0,
        )
        for p, c, a in zip(prompts, completions, [1.0, -1.0, 1.0, -1.0], strict=True)
    ]


def test_a_step_changes_lora_weights_and_not_the_base(settings: TrainerSettings) -> None:
    engine = Engine(settings)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.step(samples_for(engine))
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p, before[n])}
    assert all("lora_" in n for n in changed)  # the base model is untouched
    # PEFT starts every B at zero (A's gradient is zero until B moves): step one moves each B.
    lora_b = {n for n in before if "lora_B" in n}
    assert lora_b and lora_b <= changed


def test_importance_ratio_is_one_for_fresh_data_and_not_for_stale(
    settings: TrainerSettings,
) -> None:
    engine = Engine(settings)
    stale = samples_for(engine)  # sampled by the policy as it is now...
    fresh_stats = engine.step(stale)  # ...so for this step they are fresh
    assert fresh_stats.is_ratio_min == pytest.approx(1.0, abs=1e-4)
    assert fresh_stats.is_ratio_max == pytest.approx(1.0, abs=1e-4)
    # The policy moved: the same samples are now from an older version.
    stale_stats = engine.step(stale)
    assert abs(stale_stats.is_ratio_max - 1) > 1e-3 or abs(stale_stats.is_ratio_min - 1) > 1e-3
    assert stale_stats.is_ratio_mean <= settings.is_cap + 1e-6  # the weights are truncated
    refreshed = engine.step(samples_for(engine))
    assert refreshed.is_ratio_mean == pytest.approx(1.0, abs=1e-4)


def test_saved_adapter_is_what_vllm_loads_and_resumes(
    settings: TrainerSettings, tmp_path: Path
) -> None:
    engine = Engine(settings)
    engine.step(samples_for(engine))
    engine.save_adapter(tmp_path / "policy-v1")
    files = {p.name for p in (tmp_path / "policy-v1").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= files
    resumed = Engine(settings, resume_from=tmp_path / "policy-v1")
    a = dict(engine.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, a[name]), name


def test_bfloat16_and_gradient_checkpointing_reach_the_model(settings: TrainerSettings) -> None:
    """The GPU options (bench/gpu_smoke.py runs them on a GPU): a bfloat16 base under float32
    LoRA weights, activations recomputed in the backward pass, and a step still trains."""
    engine = Engine(
        settings.model_copy(update={"dtype": "bfloat16", "gradient_checkpointing": True})
    )
    params = dict(engine.model.named_parameters())
    assert {p.dtype for p in params.values() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert engine.model.is_gradient_checkpointing
    before = {n: p.detach().clone() for n, p in params.items() if "lora_B" in n}
    engine.step(samples_for(engine))
    assert all(not torch.equal(params[n], b) for n, b in before.items())


def test_a_4bit_base_without_bitsandbytes_fails_at_start_naming_the_fix(
    settings: TrainerSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name: None if name == "bitsandbytes" else find_spec(name),
    )
    fields = {"model": settings.model, "vllm": ["http://127.0.0.1:9"], "home": settings.home}
    fields["adapters_dir"] = settings.adapters_dir
    TrainerSettings(**fields)  # fine without it...
    with pytest.raises(ValidationError, match="pip install bitsandbytes"):
        TrainerSettings(**fields, load_in_4bit=True)  # ...until a 4-bit base needs it


def test_a_4bit_base_is_not_sharded(settings: TrainerSettings) -> None:
    """FSDP2 would turn bitsandbytes' 4-bit weights into plain ones: refused at start."""
    fields = {"model": settings.model, "vllm": ["http://127.0.0.1:9"], "home": settings.home}
    fields["adapters_dir"] = settings.adapters_dir
    TrainerSettings(**fields, shard_base=True)
    with pytest.raises(ValidationError, match="load_in_4bit and shard_base"):
        TrainerSettings(**fields, shard_base=True, load_in_4bit=True)


def test_the_trainer_does_not_import_vllm() -> None:
    """TRL imports vLLM with GRPOTrainer whenever it is installed, though the trainer never uses
    TRL's vLLM integration (trainer/learner/grpo.py tells TRL it is not there): ~5 s and ~170 MB
    in every trainer process, and every rank of one."""
    check = "import sys, trainer.loop, trainer.learner.ranks; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
