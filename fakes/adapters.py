"""LoRA adapters with random weights, saved as the trainer saves its own (PEFT's
`save_pretrained`: adapter_config.json + adapter_model.safetensors, with trainer/learner/engine.py's
targets and settings), for tests and benchmarks that need many distinct adapters vLLM loads.

Each adapter's weights come from its own seed and are large enough that two adapters answer a
greedy prompt differently: a call served by the wrong adapter (or by the base model) shows.

    dirs = make_adapters(model_dir, out_dir, ["acme.policy-v1", "acme.writer-v2"])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from core import policy
from core.database import Sessions

# trainer/models.py's LORA_TARGETS for Qwen2 (fakes/ stands beside the trainer, not on it).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHT_STD = 0.5  # of A and B: enough to move the tiny model's greedy answer, not to make NaNs


def make_adapters(
    model_dir: Path, out_dir: Path, names: Sequence[str], *, rank: int = 8, seed: int = 0
) -> list[Path]:
    """One adapter directory per name under `out_dir` (`out_dir/name`), for the model in
    `model_dir`; a directory that exists already is kept as it is."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=TARGETS,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    lora = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    dirs = []
    for i, name in enumerate(names):
        target = out_dir / name
        dirs.append(target)
        if (target / "adapter_model.safetensors").exists():
            continue
        generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
        with torch.no_grad():
            for p in lora:
                p.copy_(torch.randn(p.shape, generator=generator) * WEIGHT_STD)
        tmp = target.with_name(target.name + ".tmp")
        peft_model.save_pretrained(str(tmp))
        tmp.rename(target)
    return dirs


def publish_first(
    sessions: Sessions, lineage: str, name: str, path: Path, load: Callable[[str, str], object]
) -> None:
    """`name` (at `path`) as `lineage`'s first version, as the trainer publishes: `load` it
    into vLLM (the trainer's `load_everywhere`), then record it current."""
    load(name, str(path))
    with sessions.begin() as session:
        policy.publish(
            session=session,
            lineage=lineage,
            parent=None,
            version=int(name.rpartition("-v")[2]),
            path=str(path),
            base_model="demo",
            stats={},
            trained_transitions=0,
        )
