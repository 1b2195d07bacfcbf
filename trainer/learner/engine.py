"""One GRPO + LoRA update on recorded transitions, with TRL's loss as the engine.

TRL (pinned: trl==1.16.0; its private hooks are overridden in grpo.py) owns the loss: PPO
clipping (`epsilon`), its aggregation (`loss_type`), the optional KL to the base model (`beta`).
We own the data and the off-policy maths (docs/off_policy.md): token ids exactly as vLLM sampled
them (never re-tokenised); each token's log-probability recomputed under the distribution its
call was really sampled from (`trainer/learner/logprobs.py`: its own temperature,
top-k/top-p/min-p, penalties, bias), so it compares like with like with the behaviour log-probs
vLLM reported (`--logprobs-mode processed_logprobs`); the importance weights and rejection from
those to the learner (`trainer/learner/correction.py`); and advantages from
`trainer/data/advantages.py`.

The model (model.py), adapter, optimizer and TRL trainer object (grpo.py) live as long as the
Engine (one per process).
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from transformers import AutoTokenizer

from trainer.config import TrainerSettings
from trainer.data.batch import ModelLimits, Sample
from trainer.learner.anchor import Anchor
from trainer.learner.correction import Tally
from trainer.learner.distributed import (
    World,
    average,
    average_gradients,
    broadcast_parameters,
    everyone,
    gather_correction,
    reshard,
)
from trainer.learner.grpo import grpo_trainer
from trainer.learner.microbatch import lengths, pieces, share
from trainer.learner.model import adapted
from trainer.learner.scoring import Completion, completion_logprobs
from trainer.learner.sft import Demo, SftStats, backward, completion_tokens
from trainer.learner.sft import lengths as sft_lengths

# The trainable weights, both optimizers' states and the KL's anchor: what undoing a step needs.
Weights = dict[str, torch.Tensor]
Snapshot = tuple[Weights, tuple[dict[str, Any], dict[str, Any]], Weights | None]
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
        model, peft_config = adapted(settings, bf16, resume_from, base, adapter)
        trainer = grpo_trainer(settings, model, tokenizer, peft_config, bf16=bf16)
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
        own = {n: p for n, p in trainer.model.named_parameters() if self._own(n)}
        self._trained = list(own.values())
        broadcast_parameters(self._trained, self.world)
        # The KL's reference when it is not the base model (anchor.py); TRL reads `ref_model`.
        self.anchor: Anchor | None = None
        if settings.beta > 0 and settings.kl_anchor == "start":
            self.anchor = trainer.ref_model = Anchor(own, adapter)
            self.anchor.take(resume_from)
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
        if self.anchor is not None:  # GRPO from here is held near what the demonstrations taught
            self.anchor.hold()
        return SftStats(loss=loss, tokens=tokens, seconds=time.perf_counter() - started)

    @property
    def tokenizer(self) -> Any:
        return self.trainer.processing_class

    def score(self, rows: Sequence[Completion]) -> list[float]:
        """Each recorded completion's log-probability under this engine's weights now, under
        its call's sampling settings (trainer/learner/scoring.py): no gradient, no state changed."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        device = self.trainer.accelerator.device
        settings = self.trainer.settings
        model = self._use()
        try:
            return completion_logprobs(
                model,
                rows,
                pad_id=pad,
                device=device,
                share=settings.shares_prompts,
                pass_tokens=settings.micro_batch_tokens,
            )
        finally:
            if settings.shard_base:  # each rank's units as a step leaves them
                reshard(model)

    def at(self, weights: Snapshot) -> AtWeights:
        """A scorer under `weights` (the current version's, while the engine holds a
        candidate's): the off-policy estimate's other side."""
        return AtWeights(self, weights)

    def snapshot(self) -> Snapshot:
        """The trainable weights and optimizer state, to undo a step that could not be published."""
        weights = {n: p.detach().clone() for n, p in self._use().named_parameters() if self._own(n)}
        optimizers = (self.trainer.optimizer.state_dict(), self.sft_optimizer.state_dict())
        anchor = self.anchor.weights if self.anchor is not None else None  # replaced, never changed
        return weights, copy.deepcopy(optimizers), anchor

    def restore(self, snapshot: Snapshot) -> None:
        weights, (optimizer_state, sft_state), anchor = snapshot
        if self.anchor is not None and anchor is not None:
            self.anchor.weights = anchor
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
        if self.anchor is not None:
            self.anchor.take(adapter_dir)

    def save_adapter(self, out_dir: Path) -> None:
        """adapter_config.json + adapter_model.safetensors (vLLM loads these); optimizer beside."""
        self._use().save_pretrained(out_dir, selected_adapters=[self.adapter])
        if self.adapter != "default":  # PEFT puts any other adapter in a folder of its name
            for path in (out_dir / self.adapter).iterdir():
                path.rename(out_dir / path.name)
            (out_dir / self.adapter).rmdir()
        torch.save(self.trainer.optimizer.state_dict(), out_dir / "optimizer.pt")
        torch.save(self.sft_optimizer.state_dict(), out_dir / SFT_OPTIMIZER)
        if self.anchor is not None:
            self.anchor.save(out_dir)  # a restart or a rollback to it holds the same anchor


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
