"""TRL's GRPOTrainer, fed recorded transitions instead of generating: its loss (PPO clipping, its
aggregation, the optional KL), our rows, advantages, per-row log-probabilities and off-policy
correction. TRL is pinned (trl==1.16.0): the hooks overridden here are private. The Engine
(engine.py) owns one for as long as it lives and never calls `train()`.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

import torch
from datasets import Dataset

from trainer.config import TrainerSettings
from trainer.learner.anchor import Anchor
from trainer.learner.correction import Correction, correct
from trainer.learner.logprobs import processed_logprobs
from trainer.learner.shared_prompts import completion_logits

# We never use TRL's vLLM integration (the tokens come from the proxy's vLLM). Told vLLM is not
# there, importing GRPOTrainer does not import vLLM, which cost every trainer process ~5 s and
# ~170 MB here, nor warn about vLLM's version. TRL asks only while its modules are imported.
importlib.import_module("trl.import_utils").is_vllm_available = lambda *_, **__: False  # type: ignore[attr-defined]
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # noqa: E402


def _echo_reward(completions: list[Any], reward: list[float], **_: Any) -> list[float]:
    """TRL requires a reward function; this one reports our recorded return in its metrics."""
    return reward


class TransitionGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose "generation" returns our recorded transitions, with our advantages, our
    per-row log-probabilities and our off-policy correction."""

    def __init__(self, *, settings: TrainerSettings, **kwargs: Any) -> None:
        # The constructor needs a dataset; it is never read (we never call train()).
        super().__init__(
            reward_funcs=[cast(Any, _echo_reward)],
            train_dataset=Dataset.from_dict({"prompt": [""]}),
            **kwargs,
        )
        # TRL computes the step's starting log-probs and multiplies the loss by
        # `importance_sampling_ratio` only in its vLLM mode (grpo_trainer.py: old logps L2644,
        # the loss L3146). Our tokens did come from vLLM, but TRL must not build its own vLLM
        # client (L1105), so the flag goes on after construction; nothing else on our path reads
        # it, since `_generate` is ours. The ratio itself is ours (`_correct`).
        self.use_vllm = True
        self.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which we don't run
        self.settings = settings
        self._rows: list[dict[str, Any]] = []
        self._active: list[int] = []  # which of _rows the next log-prob pass scores, in order
        self.correction: Correction | None = None
        self.share = 1.0  # what the next loss is multiplied by (trainer/learner/microbatch.py)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """`training_step` gets a piece of a batch the engine already prepared (`prepare`)."""
        return inputs

    def prepare(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The step's batch as TRL's loss reads it: padded ids and masks, our advantages, the
        starting log-probs and our off-policy correction (TRL's generation step, on our rows)."""
        return self._generate_and_score_completions(rows)

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
        self._active = list(range(len(rows)))
        self.num_generations = len(rows)  # one "group" always fits TRL's view(-1, G)
        batch: dict[str, Any] = super()._generate_and_score_completions(rows)
        # TRL recomputed advantages from rewards; ours (task groups, baselines) replace them
        # before TRL shuffles the batch, so rows stay aligned; `row` follows each row through
        # the shuffle, so the loss pass knows its sampling settings.
        batch["advantages"] = torch.tensor(
            [r["advantage"] for r in rows], dtype=torch.float32, device=self.accelerator.device
        )
        batch["row"] = torch.arange(len(rows))
        self._correct(batch, rows)
        return batch

    def _correct(self, batch: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Our importance weights and rejection in place of TRL's (trainer/learner/correction.py). A
        rejected token leaves the loss and its denominator through TRL's `tool_mask`, which
        masks the loss only (the completion mask also feeds attention)."""
        s = self.settings
        real_B = torch.tensor(
            [not r.get("ballast", False) for r in rows], device=self.accelerator.device
        )
        mask = batch["completion_mask"] * real_B[:, None]
        result = correct(
            batch["old_per_token_logps"],
            batch["sampling_per_token_logps"],
            mask,
            [r["staleness"] for r in rows],
            is_cap=s.is_cap,
            mask=s.off_policy_mask,
            bound=s.off_policy_bound,
            veto=s.off_policy_veto,
        )
        batch["importance_sampling_ratio"] = result.weights_BT
        batch["tool_mask"] = result.keep_BT * real_B[:, None]
        kept = (mask * result.keep_BT).sum()
        batch["num_items_in_batch"] = self.accelerator.gather(kept).sum()
        batch["rows_in_batch"] = self.accelerator.gather(real_B.sum()).sum()
        self.correction = result

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        self._active = inputs["row"].tolist()
        return super()._compute_loss(model, inputs) * self.share  # type: ignore[no-untyped-call]

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """Each completion token's log-probability under its own row's sampling distribution
        (TRL's fused head knows one temperature and no truncation). `input_ids` rows are
        `self._active`'s, in order. The logits are materialised, (rows, tokens, vocabulary) a
        chunk of `batch_size` rows at a time; rows with one prompt forward it once
        (trainer/learner/shared_prompts.py)."""
        if isinstance(model, Anchor):  # the KL's reference under kl_anchor=start (anchor.py)
            with model:
                return self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size
                )
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            rows = [self._rows[i] for i in self._active[start:end]]
            ids, attention = input_ids[start:end], attention_mask[start:end]
            logits = completion_logits(  # the logits before each completion token
                model,
                ids,
                attention,
                [r["prompt_ids"] for r in rows],
                logits_to_keep,
                share=self.settings.shares_prompts,
            )
            lp, ent = processed_logprobs(
                logits,
                ids[:, -logits_to_keep:],
                attention[:, -logits_to_keep:],
                [r["prompt_ids"] for r in rows],
                [r["sampling"] for r in rows],
                with_entropy=compute_entropy,
            )
            logps.append(lp)
            if ent is not None:
                entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


def grpo_trainer(
    settings: TrainerSettings, model: Any, tokenizer: Any, peft_config: Any, *, bf16: bool
) -> Any:
    """The TRL trainer object of an Engine, its optimizer made (constant learning rate).
    `peft_config`: TRL wraps a bare model in a new adapter; None: `model` has its adapter."""
    args = GRPOConfig(
        output_dir=str(settings.home / "trainer-scratch"),
        use_cpu=not torch.cuda.is_available(),
        bf16=bf16,  # autocast; LoRA weights stay float32 (bfloat16 on a 4-bit base: TRL)
        gradient_checkpointing=settings.gradient_checkpointing,
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
        loss_type=settings.loss_type,
        epsilon=settings.epsilon,
        beta=0.0,  # set below, or TRL makes its own reference ("ref": a resumed adapter's copy)
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=settings.is_cap,
    )
    # TRL's and transformers' attributes are typed Optional; ours are always set here.
    trainer: Any = TransitionGRPOTrainer(
        settings=settings,
        model=model,
        args=args,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    # The KL's reference: the base model (TRL turns the adapter off) unless the Engine gives
    # `ref_model` its anchor (trainer/learner/anchor.py).
    trainer.beta = settings.beta
    if settings.gradient_checkpointing:  # Trainer.train() would; we never call it
        trainer.model.gradient_checkpointing_enable({"use_reentrant": False})
    trainer.create_optimizer_and_scheduler(num_training_steps=1)  # constant LR
    return trainer
