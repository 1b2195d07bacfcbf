"""One GRPO + LoRA update on recorded transitions, with TRL's loss as the engine.

TRL (pinned: trl==1.16.0; the two hooks below are private) owns the maths: per-token log-probs,
PPO clipping (`epsilon`), the loss aggregation (`loss_type`), the optional KL to the base model
(`beta`), and the truncated importance-sampling correction exp(logp_before_step - logp_behaviour),
capped at `is_cap`. We own the data: token ids exactly as vLLM sampled them (never re-tokenised),
behaviour log-probs as vLLM reported them (`--logprobs-mode processed_logprobs`), and advantages
from `trainer/advantages.py`.

The model, adapter, optimizer and TRL trainer object live as long as the Engine (one per process).
"""

from __future__ import annotations

import copy
import json
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

with warnings.catch_warnings():
    # TRL warns that it was tested with vLLM <= 0.31; we never use TRL's vLLM integration.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

from trainer.batch import ModelLimits, Sample
from trainer.config import TrainerSettings

# The trainable weights and the optimizer state: what undoing a step needs.
Snapshot = tuple[dict[str, torch.Tensor], dict[str, Any]]

# vLLM rejects adapters with DoRA, LoRA bias or modules_to_save; these all load.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class StepStats:
    loss: float
    clip_fraction: float
    is_ratio_mean: float
    is_ratio_min: float
    is_ratio_max: float
    kl: float | None
    entropy: float
    seconds: float


def _echo_reward(completions: list[Any], reward: list[float], **_: Any) -> list[float]:
    """TRL requires a reward function; this one reports our recorded return in its metrics."""
    return reward


class _TransitionGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose "generation" returns our recorded transitions, with our advantages."""

    def __init__(self, **kwargs: Any) -> None:
        # The constructor needs a dataset; it is never read (we never call train()).
        super().__init__(
            reward_funcs=[cast(Any, _echo_reward)],
            train_dataset=Dataset.from_dict({"prompt": [""]}),
            **kwargs,
        )
        # TRL applies truncated IS only in its vLLM mode (grpo_trainer.py: old logps L2644, the
        # ratio L2660, the loss L3146). Our tokens did come from vLLM, but TRL must not build its
        # own vLLM client (L1105), so the flag goes on after construction; nothing else on our
        # path reads it, since `_generate` is ours.
        self.use_vllm = True
        self.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which we don't run
        self._rows: list[dict[str, Any]] = []

    def _generate(self, prompts: list[Any]) -> tuple[Any, ...]:
        rows = self._rows
        return (
            [r["prompt_ids"] for r in rows],
            [r["completion_ids"] for r in rows],
            None,  # tool mask
            [""] * len(rows),  # decoded completions: only for reward functions and logs
            [r["logprobs"] for r in rows],
            {},  # extra fields
            None,  # images
            [],  # tool images
        )

    def _generate_and_score_completions(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        self._rows = rows
        self.num_generations = len(rows)  # one "group" always fits TRL's view(-1, G)
        batch: dict[str, Any] = super()._generate_and_score_completions(rows)
        # TRL recomputed advantages from rewards; ours (task groups, baselines) replace them
        # before TRL shuffles the batch, so rows stay aligned.
        batch["advantages"] = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)
        return batch


class Engine:
    def __init__(self, settings: TrainerSettings, *, resume_from: Path | None = None) -> None:
        random.seed(settings.seed)
        torch.manual_seed(settings.seed)
        tokenizer = AutoTokenizer.from_pretrained(settings.model)
        model: Any = AutoModelForCausalLM.from_pretrained(settings.model, dtype=torch.float32)
        peft_config = None
        if resume_from is None:
            peft_config = LoraConfig(
                r=settings.lora_rank,
                lora_alpha=settings.lora_alpha,
                lora_dropout=0.0,
                target_modules=LORA_TARGETS,
                bias="none",
                use_dora=False,
                task_type="CAUSAL_LM",
            )
        else:
            model = PeftModel.from_pretrained(model, resume_from, is_trainable=True)
        args = GRPOConfig(
            output_dir=str(settings.home / "trainer-scratch"),
            use_cpu=not torch.cuda.is_available(),
            bf16=False,
            gradient_checkpointing=False,
            report_to="none",
            save_strategy="no",
            seed=settings.seed,
            learning_rate=settings.learning_rate,
            lr_scheduler_type="constant",
            max_grad_norm=settings.max_grad_norm,
            per_device_train_batch_size=8,  # rows per no-grad forward (old/reference log-probs)
            num_generations=2,  # only to pass TRL's validation; see _generate_and_score_completions
            steps_per_generation=1,
            num_iterations=settings.num_iterations,
            temperature=settings.temperature,
            loss_type=settings.loss_type,
            epsilon=settings.epsilon,
            beta=settings.beta,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=settings.is_cap,
        )
        # TRL's and transformers' attributes are typed Optional; ours are always set here.
        trainer: Any = _TransitionGRPOTrainer(
            model=model, args=args, processing_class=tokenizer, peft_config=peft_config
        )
        trainer.create_optimizer_and_scheduler(num_training_steps=1)  # constant LR
        if resume_from is not None and (resume_from / "optimizer.pt").exists():
            state = torch.load(resume_from / "optimizer.pt", weights_only=True)
            trainer.optimizer.load_state_dict(state)
        self.trainer = trainer

    @property
    def limits(self) -> ModelLimits:
        config = self.trainer.model.config
        return ModelLimits(config.vocab_size, config.max_position_embeddings)

    @property
    def model(self) -> Any:
        return self.trainer.model

    def step(self, samples: list[Sample]) -> StepStats:
        """One batch: `num_iterations` optimizer steps with TRL's loss."""
        trainer, model = self.trainer, self.trainer.model
        rows = [vars(s) | {"prompt": ""} for s in samples]
        started = time.perf_counter()
        losses = []
        for _ in range(trainer.args.num_iterations):  # passes 2..mu reuse TRL's buffered batch
            losses.append(trainer.training_step(model, rows, None).item())
            trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            model.zero_grad(set_to_none=True)
            trainer.state.global_step += 1
        metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items() if v}
        trainer._metrics["train"].clear()
        return StepStats(
            loss=sum(losses) / len(losses),
            clip_fraction=metrics.get("clip_ratio/region_mean", 0.0),
            is_ratio_mean=metrics["sampling/importance_sampling_ratio/mean"],
            is_ratio_min=metrics["sampling/importance_sampling_ratio/min"],
            is_ratio_max=metrics["sampling/importance_sampling_ratio/max"],
            kl=metrics.get("kl"),
            entropy=metrics["entropy"],
            seconds=time.perf_counter() - started,
        )

    def snapshot(self) -> Snapshot:
        """The trainable weights and optimizer state, to undo a step that could not be published."""
        weights = {
            n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad
        }
        return weights, copy.deepcopy(self.trainer.optimizer.state_dict())

    def restore(self, snapshot: Snapshot) -> None:
        weights, optimizer_state = snapshot
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in weights:
                    p.copy_(weights[name])
        self.trainer.optimizer.load_state_dict(optimizer_state)

    def load_adapter(self, adapter_dir: Path | None) -> None:
        """Take over a published version's weights and optimizer state (None: the base model,
        i.e. every LoRA B zero, fresh optimizer state). Raises if the adapter does not fit this
        engine's LoRA configuration (another rank or targets); the caller builds a new Engine."""
        model = self.trainer.model
        with torch.no_grad():
            if adapter_dir is None:
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.zero_()
            else:
                theirs = json.loads((adapter_dir / "adapter_config.json").read_text())
                ours = model.peft_config["default"]
                if (theirs["r"], theirs["lora_alpha"], set(theirs["target_modules"])) != (
                    ours.r,
                    ours.lora_alpha,
                    set(ours.target_modules),
                ):
                    raise ValueError(f"{adapter_dir} has another LoRA configuration")
                state = load_file(adapter_dir / "adapter_model.safetensors")
                result: Any = set_peft_model_state_dict(model, state)
                if result.unexpected_keys:
                    raise ValueError(f"{adapter_dir} has weights this engine lacks")
        optimizer = self.trainer.optimizer
        saved = adapter_dir / "optimizer.pt" if adapter_dir is not None else None
        if saved is not None and saved.exists():
            optimizer.load_state_dict(torch.load(saved, weights_only=True))
        else:
            optimizer.state.clear()

    def save_adapter(self, out_dir: Path) -> None:
        """adapter_config.json + adapter_model.safetensors (vLLM loads these); optimizer beside."""
        self.trainer.model.save_pretrained(out_dir, selected_adapters=["default"])
        torch.save(self.trainer.optimizer.state_dict(), out_dir / "optimizer.pt")
