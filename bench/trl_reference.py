"""TRL's own GRPOTrainer as the coupled reference (transformers generates, no vLLM, no proxy):
its GRPOConfig built from the settings `flywheel trainer` runs with in a benchmark's loop, so the
two learners differ in how they get their samples, not in their loss or step size.

bench/learning_curve.py (the calculator) and bench/bfcl_learning.py (SmolLM2 on BFCL) both build
their TRL arm's config here.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Mapping
from typing import Any


def setting(env: Mapping[str, str], name: str) -> Any:
    """A trainer setting as the loop runs it: `env`'s FLYWHEEL_<NAME> (a task's trainer
    environment, demo/stack.py), else TrainerSettings' default, of the default's type."""
    from trainer.config import TrainerSettings

    default = TrainerSettings.model_fields[name].default
    value = env.get(f"FLYWHEEL_{name.upper()}")
    return default if value is None else type(default)(value)


def grpo_config(
    env: Mapping[str, str],
    *,
    name: str,
    seed: int,
    samples: int,
    batch: int,
    group: int,
    max_tokens: int,
    temperature: float,
    **extra: Any,
) -> Any:
    """One optimizer step per `batch` fresh samples (`batch / group` prompts, `group` samples
    each), untempered by top-p/top-k, a constant learning rate; the loss, clip range, KL weight,
    gradient clip and iterations are the trainer's settings from `env`. `extra` goes to
    GRPOConfig as it is (e.g. `bf16=False`, `shuffle_dataset=False`)."""
    with warnings.catch_warnings():  # TRL warns about vLLM's version; no vLLM on this side
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
        from trl import GRPOConfig  # type: ignore[attr-defined]

    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"trl-{name}-"),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=seed,
        max_steps=samples // batch,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=group,
        max_completion_length=max_tokens,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=setting(env, "learning_rate"),
        lr_scheduler_type="constant",
        max_grad_norm=setting(env, "max_grad_norm"),
        num_iterations=setting(env, "num_iterations"),
        loss_type=setting(env, "loss_type"),
        epsilon=setting(env, "epsilon"),
        beta=setting(env, "beta"),
        **extra,
    )
