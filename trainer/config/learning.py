"""How a step learns: TRL's GRPO loss, PEFT LoRA, the off-policy correction, memory and
precision (trainer/learner/)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from core.settings import FlywheelSettings, split_commas

# How far a transition may be from the learner (trainer/learner/correction.py, docs/off_policy.md).
OffPolicyMask = Literal["geometric", "sequence", "token", "none"]


class LearningSettings(FlywheelSettings):
    # --- how to train (TRL's GRPO loss, PEFT LoRA) -------------------------------------------
    lora_rank: int = Field(8, description="LoRA rank (vLLM needs --max-lora-rank >= this).")
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha (updates scale by alpha/rank).")
    lora_targets: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="The modules LoRA adapts (q_proj,v_proj,...). Empty: every attention and MLP "
        "projection of the model's architecture (trainer/models.py LORA_TARGETS).",
    )
    learning_rate: float = Field(1e-4, gt=0, description="AdamW's learning rate (constant).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this norm.")
    loss_type: str = Field("dapo", description="TRL GRPO loss_type (dapo, grpo, dr_grpo, bnpo).")
    epsilon: float = Field(0.2, gt=0, description="PPO clip range.")
    beta: float = Field(0.0, ge=0, description="KL coefficient to kl_anchor's policy (0: no KL).")
    kl_anchor: Literal["start", "base"] = Field(
        "start",
        description="The KL's reference (beta > 0): the policy GRPO started from, i.e. the "
        "last weights no GRPO step made (a warm start's supervised steps, or a version "
        "imported or rolled back to), or the base model (trainer/learner/anchor.py).",
    )
    is_cap: float = Field(
        2.0,
        ge=1,
        description="Truncation of each token's importance weight pi_old/mu (TIS).",
    )
    off_policy_mask: OffPolicyMask = Field(
        "geometric",
        description="Rejection of transitions sampled too far from the learner: by the "
        "geometric mean of their token ratios, their product, or token by token, outside "
        "[1/off_policy_bound, off_policy_bound] (docs/off_policy.md).",
    )
    off_policy_bound: float = Field(
        2.0, gt=1, description="The trust region of off_policy_mask: [1/bound, bound]."
    )
    off_policy_veto: float = Field(
        1e-4,
        ge=0,
        lt=1,
        description="A transition with any token whose ratio pi_old/mu is below this is "
        "rejected (0: off); a token outside the learner's top-k/top-p set always is.",
    )
    num_iterations: int = Field(1, ge=1, description="Optimizer steps per batch (TRL's mu).")
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="Backpropagate each step's batch in pieces of at most this many padded "
        "tokens (rows x longest prompt+completion), adding up to the same gradient: the loss "
        "pass's memory grows with tokens x vocabulary. 0: the whole batch in one pass. The "
        "estimate's scoring passes (no gradient) keep to it too (0: 4,096 padded tokens).",
    )
    share_prompts: bool = Field(
        True,
        description="Rows of a batch with the same prompt (a GRPO group's samples) forward it "
        "once and only their completions each (trainer/learner/shared_prompts.py): P + G*C tokens "
        "instead of G*(P+C). Off by itself with gradient_checkpointing or shard_base.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="The base model's weights and the forward passes' precision: bfloat16 halves "
        "their memory on a GPU that has it (LoRA weights and optimizer state stay float32).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass instead of keeping them: less "
        "GPU memory for longer sequences, about a third more compute per step.",
    )
    load_in_4bit: bool = Field(
        False,
        description="QLoRA: the base model's linear layers quantised to 4-bit NF4 by bitsandbytes, "
        "the rest and the forward passes in bfloat16 (needs CUDA and bitsandbytes installed).",
    )
    shard_base: bool = Field(
        False,
        description="Under torchrun / accelerate launch: shard the frozen base model over the "
        "ranks with FSDP2 (each holds 1/N of its weights) for a base that does not fit one "
        "device; the LoRA adapter stays whole on every rank. An accelerate config with "
        "fsdp_version: 2 sets it.",
    )
    seed: int = Field(0, description="Seed of a new adapter's weights and of training's RNGs.")

    _split_learning = field_validator("lora_targets", mode="before")(split_commas)
