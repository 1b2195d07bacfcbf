"""One GRPO + LoRA update on recorded transitions, with TRL's loss as the engine.

TRL (pinned: trl==1.16.0; the hooks below are private) owns the loss: PPO clipping (`epsilon`),
its aggregation (`loss_type`), the optional KL to the base model (`beta`). We own the data and the
off-policy maths (docs/off_policy.md): token ids exactly as vLLM sampled them (never
re-tokenised); each token's log-probability recomputed under the distribution its call was really
sampled from (`trainer/learner/logprobs.py`: its own temperature, top-k/top-p/min-p, penalties,
bias), so it compares like with like with the behaviour log-probs vLLM reported
(`--logprobs-mode processed_logprobs`); the importance weights and rejection from those to the
learner (`trainer/learner/correction.py`); and advantages from `trainer/data/advantages.py`.

The model, adapter, optimizer and TRL trainer object live as long as the Engine (one per process).
"""

from __future__ import annotations

import copy
import json
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

with warnings.catch_warnings():
    # TRL warns that it was tested with vLLM <= 0.31; we never use TRL's vLLM integration.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

from trainer.config import TrainerSettings
from trainer.data.batch import ModelLimits, Sample
from trainer.learner.correction import Correction, Tally, correct
from trainer.learner.distributed import (
    World,
    average,
    average_gradients,
    broadcast_parameters,
    everyone,
    gather_correction,
    shard_base,
)
from trainer.learner.logprobs import processed_logprobs
from trainer.learner.microbatch import lengths, pieces, share
from trainer.learner.scoring import Completion, completion_logprobs
from trainer.learner.sft import Demo, SftStats, backward, completion_tokens
from trainer.learner.sft import lengths as sft_lengths
from trainer.learner.shared_prompts import completion_logits

# The trainable weights and both optimizers' states: what undoing a step needs.
Snapshot = tuple[dict[str, torch.Tensor], tuple[dict[str, Any], dict[str, Any]]]
SFT_OPTIMIZER = "sft_optimizer.pt"  # beside a version's adapter, as optimizer.pt (GRPO's)


@dataclass(frozen=True)
class StepStats:
    loss: float
    clip_fraction: float
    is_ratio_mean: float  # the truncated importance weight, over the tokens kept
    is_ratio_min: float  # the raw ratio pi_old / mu, over every token
    is_ratio_max: float
    kl: float | None
    entropy: float
    seconds: float
    by_staleness: dict[str, Tally]  # completion tokens truncated and rejected, by staleness


def _echo_reward(completions: list[Any], reward: list[float], **_: Any) -> list[float]:
    """TRL requires a reward function; this one reports our recorded return in its metrics."""
    return reward


def _four_bit() -> Any:
    """QLoRA's base: NF4 weights, double quantisation, bfloat16 compute (bitsandbytes, CUDA)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(  # type: ignore[no-untyped-call]
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


class _TransitionGRPOTrainer(GRPOTrainer):
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


def _base_model(settings: TrainerSettings, bf16: bool, *, meta: bool) -> Any:
    """The base model from its directory; `meta`: its shapes only (no memory), for a rank that
    will receive its shard of rank 0's weights."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    if meta:
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(settings.model)
            return AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    return AutoModelForCausalLM.from_pretrained(
        settings.model,
        dtype=dtype,
        quantization_config=_four_bit() if settings.load_in_4bit else None,
    )


def _lora(settings: TrainerSettings) -> LoraConfig:
    return LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=0.0,
        target_modules=settings.lora_modules,  # vLLM loads these (no DoRA, bias, modules_to_save)
        bias="none",
        use_dora=False,
        task_type="CAUSAL_LM",
    )


class Engine:
    """One lineage's adapter, optimizer state and TRL trainer object. Several engines can share
    one base model (`Engine.beside`: one PEFT adapter each, made the active one before each use,
    `_use`), so a trainer process trains many lineages for the base model's memory once."""

    def __init__(
        self,
        settings: TrainerSettings,
        *,
        resume_from: Path | None = None,
        base: Any | None = None,
        adapter: str = "default",
    ) -> None:
        random.seed(settings.seed)
        torch.manual_seed(settings.seed)
        self.adapter = adapter
        tokenizer = AutoTokenizer.from_pretrained(settings.model)
        bf16 = settings.dtype == "bfloat16" or settings.load_in_4bit
        peft_config = None
        model: Any
        if base is not None:  # one more adapter on another engine's PeftModel
            model = base
            if adapter in model.peft_config:  # a rebuild (another LoRA configuration)
                model.delete_adapter(adapter)
            if resume_from is None:
                model.add_adapter(adapter, _lora(settings))
            else:
                model.load_adapter(resume_from, adapter_name=adapter, is_trainable=True)
            model.set_adapter(adapter)  # only its weights train, so its optimizer has only them
        else:
            # sharded: rank 0 reads the weights and hands each rank its shard (`shard_base`)
            model = _base_model(
                settings, bf16, meta=settings.shard_base and not World.current().leader
            )
            if resume_from is None:
                peft_config = _lora(settings)
            else:
                with warnings.catch_warnings():  # a meta model: rank 0 hands the weights over
                    warnings.filterwarnings("ignore", message=".*to a meta parameter")
                    model = PeftModel.from_pretrained(model, resume_from, is_trainable=True)
            if settings.shard_base:  # FSDP2 over the ranks, around the adapter it leaves whole
                if peft_config is not None:
                    model, peft_config = get_peft_model(model, peft_config), None
                shard_base(model, World.current())
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
            beta=settings.beta,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=settings.is_cap,
        )
        # TRL's and transformers' attributes are typed Optional; ours are always set here.
        trainer: Any = _TransitionGRPOTrainer(
            settings=settings,
            model=model,
            args=args,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        if settings.gradient_checkpointing:  # Trainer.train() would; we never call it
            trainer.model.gradient_checkpointing_enable({"use_reentrant": False})
        trainer.create_optimizer_and_scheduler(num_training_steps=1)  # constant LR
        if resume_from is not None and (resume_from / "optimizer.pt").exists():
            state = torch.load(resume_from / "optimizer.pt", weights_only=True)
            trainer.optimizer.load_state_dict(state)
        self.trainer = trainer
        # Its optimizer holds its own adapter's weights (the only trainable ones when it was
        # made). From here every adapter's stay trainable: an inactive one is not in the forward
        # pass, so it gets no gradient, and switching adapters need not walk them all (`_use`).
        if base is not None:
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.requires_grad_(True)
        # The LoRA layers, as the PeftModel the TRL trainer holds has them (TRL wraps a bare model).
        self._layers = [m for m in trainer.model.modules() if isinstance(m, BaseTunerLayer)]
        # Under torchrun / accelerate launch: the ranks' adapters start equal, and their gradients
        # are averaged before each optimizer step (trainer/learner/distributed.py).
        self.world = World.current()
        self._trained = [p for n, p in trainer.model.named_parameters() if self._own(n)]
        broadcast_parameters(self._trained, self.world)
        # Supervised steps' own AdamW (trainer/learner/sft.py: its moments kept apart from GRPO's).
        self.sft_optimizer = torch.optim.AdamW(
            self._trained, lr=settings.sft_learning_rate, weight_decay=0.0
        )
        if resume_from is not None and (resume_from / SFT_OPTIMIZER).exists():
            self.sft_optimizer.load_state_dict(
                torch.load(resume_from / SFT_OPTIMIZER, weights_only=True)
            )

    def beside(self, settings: TrainerSettings, adapter: str, resume_from: Path | None) -> Engine:
        """Another lineage's engine on this one's base model (its weights are not copied)."""
        return Engine(settings, resume_from=resume_from, base=self.model, adapter=adapter)

    def _use(self) -> Any:
        """The model with this engine's adapter the one that runs and trains. PEFT's own
        `set_adapter` also sets requires-grad on every adapter of every layer, which grows with
        the lineages; the active adapter alone is what the forward pass reads."""
        model = self.trainer.model
        if model.active_adapter != self.adapter:
            for layer in self._layers:
                layer._active_adapter = [self.adapter]
            model.base_model.active_adapter = self.adapter  # what PEFT's set_adapter sets
            model.active_adapter = self.adapter
        return model

    def _own(self, name: str) -> bool:
        """Whether a parameter (by its PEFT name) is this engine's adapter's."""
        return f".{self.adapter}." in name and "lora_" in name

    @property
    def limits(self) -> ModelLimits:
        config = self.trainer.model.config
        return ModelLimits(config.vocab_size, config.max_position_embeddings)

    @property
    def model(self) -> Any:
        return self.trainer.model

    def step(self, samples: list[Sample]) -> StepStats:
        """One batch: `num_iterations` optimizer steps with TRL's loss, each backpropagated in
        pieces of at most `micro_batch_tokens` (trainer/learner/microbatch.py)."""
        trainer, model = self.trainer, self._use()
        rows = [vars(s) | {"prompt": ""} for s in samples]
        started = time.perf_counter()
        losses = []
        model.train()
        batch = trainer.prepare(rows)
        budget = trainer.settings.micro_batch_tokens
        # TRL gathers per-row metrics in each loss pass: pieces cut alike on every rank
        ranks = everyone(lengths(batch), self.world) if budget > 0 else ()
        parts = pieces(batch, budget, ranks)
        for _ in range(trainer.args.num_iterations):  # passes 2..mu reuse the prepared batch
            loss = 0.0
            for part in parts:
                trainer.share = share(trainer.settings.loss_type, part, batch, self.world.size)
                loss += trainer.training_step(model, part, None).item()
            average_gradients(self._trained, self.world)
            losses.append(average(loss, self.world, trainer.accelerator.device))
            trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            model.zero_grad(set_to_none=True)
            trainer.state.global_step += 1
        metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items() if v}
        trainer._metrics["train"].clear()
        correction = gather_correction(trainer.correction, self.world)
        return StepStats(
            loss=sum(losses) / len(losses),
            clip_fraction=metrics.get("clip_ratio/region_mean", 0.0),
            is_ratio_mean=correction.weight_mean,
            is_ratio_min=correction.ratio_min,
            is_ratio_max=correction.ratio_max,
            kl=metrics.get("kl"),
            entropy=metrics["entropy"],
            seconds=time.perf_counter() - started,
            by_staleness=correction.by_staleness,
        )

    def sft_step(self, demos: list[Demo]) -> SftStats:
        """One supervised step on demonstrations (trainer/learner/sft.py), its own optimizer's."""
        model, settings = self._use(), self.trainer.settings
        started = time.perf_counter()
        model.train()
        tokens = sum(everyone(completion_tokens(demos), self.world))
        budget = settings.micro_batch_tokens
        ranks = everyone(sft_lengths(demos), self.world) if budget > 0 else ()  # cut alike
        tokenizer = self.trainer.processing_class
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        loss = backward(
            model,
            demos,
            budget=budget,
            pad_id=pad,
            device=self.trainer.accelerator.device,
            total=max(1, tokens) / self.world.size,  # the gradients are averaged over the ranks
            share=settings.shares_prompts,
            ranks=ranks,
        )
        average_gradients(self._trained, self.world)
        loss = average(loss, self.world, self.trainer.accelerator.device)
        self.trainer.accelerator.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        self.sft_optimizer.step()
        model.zero_grad(set_to_none=True)
        return SftStats(loss=loss, tokens=tokens, seconds=time.perf_counter() - started)

    @property
    def tokenizer(self) -> Any:
        return self.trainer.processing_class

    def score(self, rows: Sequence[Completion]) -> list[float]:
        """Each recorded completion's log-probability under this engine's weights now, under
        its call's sampling settings (trainer/learner/scoring.py): no gradient, no state changed."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        device = self.trainer.accelerator.device
        share = self.trainer.settings.shares_prompts
        return completion_logprobs(self._use(), rows, pad_id=pad, device=device, share=share)

    def snapshot(self) -> Snapshot:
        """The trainable weights and optimizer state, to undo a step that could not be published."""
        weights = {n: p.detach().clone() for n, p in self._use().named_parameters() if self._own(n)}
        optimizers = (self.trainer.optimizer.state_dict(), self.sft_optimizer.state_dict())
        return weights, copy.deepcopy(optimizers)

    def restore(self, snapshot: Snapshot) -> None:
        weights, (optimizer_state, sft_state) = snapshot
        with torch.no_grad():
            for name, p in self._use().named_parameters():
                if name in weights:
                    p.copy_(weights[name])
        self.trainer.optimizer.load_state_dict(optimizer_state)
        self.sft_optimizer.load_state_dict(sft_state)

    def load_adapter(self, adapter_dir: Path | None) -> None:
        """Take over a published version's weights and optimizer state (None: the base model,
        i.e. every LoRA B zero, fresh optimizer state). Raises if the adapter does not fit this
        engine's LoRA configuration (another rank or targets); the caller builds a new Engine."""
        model = self._use()
        with torch.no_grad():
            if adapter_dir is None:
                for name, p in model.named_parameters():
                    if "lora_B" in name and self._own(name):
                        p.zero_()
            else:
                theirs = json.loads((adapter_dir / "adapter_config.json").read_text())
                ours = model.peft_config[self.adapter]
                if (theirs["r"], theirs["lora_alpha"], set(theirs["target_modules"])) != (
                    ours.r,
                    ours.lora_alpha,
                    set(ours.target_modules),
                ):
                    raise ValueError(f"{adapter_dir} has another LoRA configuration")
                state = load_file(adapter_dir / "adapter_model.safetensors")
                result: Any = set_peft_model_state_dict(model, state, adapter_name=self.adapter)
                if result.unexpected_keys:
                    raise ValueError(f"{adapter_dir} has weights this engine lacks")
        for optimizer, name in (
            (self.trainer.optimizer, "optimizer.pt"),
            (self.sft_optimizer, SFT_OPTIMIZER),
        ):
            saved = adapter_dir / name if adapter_dir is not None else None
            if saved is not None and saved.exists():
                optimizer.load_state_dict(torch.load(saved, weights_only=True))
            else:
                optimizer.state.clear()

    def save_adapter(self, out_dir: Path) -> None:
        """adapter_config.json + adapter_model.safetensors (vLLM loads these); optimizer beside."""
        self._use().save_pretrained(out_dir, selected_adapters=[self.adapter])
        if self.adapter != "default":  # PEFT puts any other adapter in a folder of its name
            for path in (out_dir / self.adapter).iterdir():
                path.rename(out_dir / path.name)
            (out_dir / self.adapter).rmdir()
        torch.save(self.trainer.optimizer.state_dict(), out_dir / "optimizer.pt")
        torch.save(self.sft_optimizer.state_dict(), out_dir / SFT_OPTIMIZER)


class AtWeights:
    """Scores under other weights (a snapshot's: the current version's, while the engine holds
    a candidate's), the engine's own put back after."""

    def __init__(self, engine: Engine, weights: Snapshot) -> None:
        self.engine, self.weights = engine, weights

    def score(self, rows: Sequence[Completion]) -> list[float]:
        now = self.engine.snapshot()
        self.engine.restore(self.weights)
        try:
            return self.engine.score(rows)
        finally:
            self.engine.restore(now)
