"""Settings of the trainer process, built once at start-up and passed down.

Every field is also a `FLYWHEEL_*` environment variable; lists are comma-separated there.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode

from core import canary, naming
from core.settings import DatabaseSettings, split_commas, vllm_base_urls
from trainer import models

# vLLM accepts only these LoRA ranks (--max-lora-rank must be one of them, and >= ours).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# How far a transition may be from the learner (trainer/learner/correction.py, docs/off_policy.md).
OffPolicyMask = Literal["geometric", "sequence", "token", "none"]
# The off-policy estimator of a candidate (trainer/ope.py, docs/promotion.md). Here, not there:
# this module is imported by every process's CLI, and trainer/ope.py needs numpy, which the proxy
# image does not have (the first container built from Dockerfile.proxy could not start).
OpeMethod = Literal["wis", "dr"]


class TrainerSettings(DatabaseSettings):
    # --- where things are -----------------------------------------------------------------
    model: Path = Field(
        ...,
        description="Base model: a Hugging Face directory (the one vLLM serves), a .gguf file or "
        "a packaged model (`smollm2-135m`), converted once into `home/models/`, or a hub id "
        "(org/name, where the hub is reachable). trainer/models.py.",
    )
    vllm: Annotated[list[str], NoDecode] = Field(
        ..., description="vLLM base URL(s); every new adapter is loaded into each before use."
    )
    vllm_api_key: SecretStr | None = Field(None, description="Bearer key for vLLM's endpoints.")
    adapters_dir: Path = Field(
        ..., description="Where adapters are written (`policy-vN/`); vLLM must read the same path."
    )
    lineage: str = Field(
        "policy",
        description="The adapter lineage it trains (named `<lineage>-vN`): the transitions the "
        "proxy served from it (its FLYWHEEL_ADAPTER_PER_AGENT). A tenant's own lineage is "
        "`<tenant>.<lineage>` (`acme.policy`): only that tenant's calls. One trainer per lineage.",
    )
    lineages: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Several lineages trained by this one process, over one copy of the base "
        "model (a LoRA adapter and optimizer state each), in turn: `acme.policy,globex.policy`, "
        "or patterns (`*.policy`: every tenant's policy, taken in as it appears). Empty: "
        "`lineage` alone.",
    )
    lineage_discover_s: float = Field(
        10.0,
        gt=0,
        description="How often a `lineages` pattern (`*.policy`) looks for lineages it does not "
        "train yet (credited transitions waiting, or a current version).",
    )
    trainer_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Who holds a claim (shown in the transition table).",
    )

    # --- what to train on -----------------------------------------------------------------
    min_episodes: int = Field(8, ge=1, description="Train once this many episodes are claimable.")
    min_groups: int = Field(
        1, ge=0, description="...and at least this many GRPO groups (tasks with >= 2 episodes)."
    )
    max_batch_transitions: int = Field(256, ge=1, description="Most transitions in one step.")
    agents: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Selective optimisation: train only these agent names (empty: all agents).",
    )
    tenants: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Train only on these tenants' traffic (`default`: FLYWHEEL_API_KEYS and "
        "unauthenticated calls; empty: every tenant).",
    )
    ungrouped: Literal["baseline", "drop"] = Field(
        "baseline",
        description="Transitions whose task has one episode: advantage against a running "
        "per-agent baseline, or set aside.",
    )
    flat_groups: Literal["train", "skip"] = Field(
        "train",
        description="A task group whose every attempt earned the same return has no advantage "
        "to learn from: train keeps it in the step (its tokens count in the loss's "
        "normalisation); skip sets its transitions aside (`no_signal`; DAPO's dynamic sampling), "
        "so a batch of nothing else takes no step and publishes no version.",
    )
    baseline_momentum: float = Field(
        0.9, ge=0, lt=1, description="Running mean/std decay of the per-agent baseline."
    )
    max_staleness: int | None = Field(
        10_000,
        ge=0,
        description="Set aside transitions sampled more than this many of the lineage's versions "
        "before the step (None: no limit). The importance weights already discount stale data "
        "(docs/off_policy.md): this is a backstop, not the trust region.",
    )
    max_age_s: float = Field(
        30 * 86400,
        gt=0,
        description="Set aside transitions whose call is older than this when a trainer gets to "
        "them (a reward may come days after its episode; the weights decide how much it counts).",
    )
    generation_config: Literal["vllm", "auto"] = Field(
        "vllm",
        description="What vLLM was started with as --generation-config: the defaults it gave "
        "a request's sampling settings it left out (vllm: OpenAI's; auto: the model's "
        "generation_config.json). Flywheel's stack and images start vLLM with `vllm`.",
    )
    lease_s: float = Field(
        600, gt=0, description="A claim not finished by then can be taken by another trainer."
    )
    poll_s: float = Field(1.0, gt=0, description="How often to look for enough new data.")
    max_train_attempts: int = Field(
        3,
        ge=1,
        description="A transition whose batch failed the step this often (an error building or "
        "training it; an outage or a lost claim does not count) is set aside as `train_failed`.",
    )
    backoff_s: float = Field(
        1.0,
        gt=0,
        description="After a step fails on Postgres or vLLM (not on its batch), wait this long, "
        "doubling each failure in a row up to backoff_max_s; the batch keeps its attempts.",
    )
    backoff_max_s: float = Field(60.0, gt=0, description="The longest back-off between tries.")
    rank_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Under torchrun / accelerate launch: how long a rank waits in a collective "
        "(a step's, or for rank 0's next command, sent at least once a turn) before the group "
        "is given up and the launcher restarts it.",
    )

    # --- demonstrations: supervised steps (trainer/learner/sft.py) ---------------------------
    demonstrations: Literal["first", "mix", "off"] = Field(
        "first",
        description="The lineage's demonstrations (POST /v1/demonstrations): first (a warm "
        "start: supervised steps while any is due an epoch, GRPO after), mix (a supervised step "
        "and a GRPO step in turn while both have data) or off (never trained).",
    )
    sft_epochs: int = Field(
        1, ge=1, description="Epochs over the demonstrations: each is trained this many times."
    )
    sft_batch: int = Field(8, ge=1, description="Demonstrations in one supervised step.")
    sft_learning_rate: float = Field(
        2e-4,
        gt=0,
        description="The supervised steps' AdamW learning rate (their own optimizer, apart from "
        "GRPO's: a warm start wants a larger one).",
    )

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
    beta: float = Field(0.0, ge=0, description="KL coefficient to the base model (0: no KL).")
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
        "pass's memory grows with tokens x vocabulary. 0: the whole batch in one pass.",
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

    # --- publishing -------------------------------------------------------------------------
    retain_versions: int = Field(
        3, ge=1, description="Adapters kept loaded in vLLM; older ones are unloaded, then deleted."
    )
    retire_grace_s: float = Field(
        120.0,
        ge=0,
        description="A retired version (an old one, or a rolled-back canary) is unloaded and "
        "deleted only this long after it was retired: calls routed to it just before still find "
        "it (vLLM reloads a queued call's adapter from disk, and a missing one kills its engine).",
    )
    reconcile_s: float = Field(
        5.0, gt=0, description="How often to check every vLLM still has the current adapter."
    )
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus port (0: off).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps (demos).")

    # --- canary releases (core/canary.py) ---------------------------------------------------
    canary_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of the lineage's episodes a new version serves until the reward "
        "decides (0: off, a new version is current at once).",
    )
    canary_min_episodes: int = Field(
        30, ge=2, description="Rewarded episodes on each side before the test may decide."
    )
    canary_alpha: float = Field(0.05, gt=0, lt=0.5, description="Each one-sided test's level.")
    canary_margin: float = Field(
        0.02, ge=0, description="Mean reward a candidate may lose and still be promoted."
    )
    canary_max_s: float = Field(
        900.0, gt=0, description="Undecided after this long: the fallback decides."
    )
    canary_fallback: Literal["promote", "rollback"] = Field(
        "promote",
        description="What an undecided canary does after canary_max_s: promote (no harm shown "
        "in that time) or rollback (only what was shown not worse ships).",
    )
    canary_check_s: float = Field(5.0, gt=0, description="How often to test an open canary.")

    # --- off-policy evaluation of each candidate (trainer/candidate.py, docs/promotion.md) ---
    ope: Literal["off", "log"] = Field(
        "off",
        description="Estimate each new version's episode reward from logged traffic before it "
        "is published, against the current version's (`log`: in the step log and the version's "
        "stats; `gate` acts on it).",
    )
    ope_holdout: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="While `ope` is on, this share of the lineage's episodes (by a hash of the "
        "episode id) is never trained: set aside as `ope_holdout`, it is what each new version "
        "is estimated on, episodes no version learned from. 0: only the current version's "
        "episodes no step has claimed yet (few, when the trainer keeps up).",
    )
    ope_episodes: int = Field(
        256,
        ge=1,
        description="Logged episodes it is estimated on at most, the newest rewarded ones: one "
        "forward pass per call under the new weights, and one more under the current version's "
        "for a call another version served.",
    )
    ope_max_age_s: float = Field(
        0.0,
        ge=0,
        description="Logged episodes older than this (their newest call) are not estimated on: "
        "what the agents were asked then may no longer be what they are asked. 0: any age.",
    )
    ope_method: OpeMethod = Field(
        "dr",
        description="Weighted doubly robust with a per-task baseline, or per-decision "
        "self-normalised importance sampling.",
    )
    ope_clip: float = Field(10.0, gt=1, description="The largest importance weight kept.")
    ope_min_ess: float = Field(
        30.0,
        gt=0,
        description="Under this effective sample size the estimate is refused (not enough "
        "overlap).",
    )
    ope_level: float = Field(
        0.9, gt=0, lt=1, description="The bootstrap interval's (two-sided) coverage."
    )
    ope_resamples: int = Field(1000, ge=10, description="Bootstrap draws.")

    # --- eval sets (trainer/evals.py, `flywheel eval add`) ----------------------------------
    evals: Literal["ask", "off"] = Field(
        "ask",
        description="Ask each new version the lineage's eval sets (if it has any) at temperature "
        "0 before it serves, loaded in vLLM under its own name but no alias's, and store the "
        "scores beside the current version's (`gate` may act on them).",
    )
    eval_max_tokens: int = Field(
        256, ge=1, description="An eval answer's bound where its item names none."
    )
    eval_concurrency: int = Field(8, ge=1, description="Eval questions in flight at once.")
    eval_timeout_s: float = Field(120.0, gt=0, description="One eval answer's time limit.")

    # --- the promotion gate (trainer/gate.py) ----------------------------------------------
    gate: Literal["off", "ope", "evals", "ope+evals"] = Field(
        "off",
        description="Decide each new version before it serves from its off-policy estimate "
        "(`ope`, made whatever `ope` says; decided before vLLM loads it), its eval sets "
        "(`evals`: asked whatever `evals` says) or both (each must pass): a version that fails is "
        "recorded, retired and never served; training goes on from the current version.",
    )
    gate_margin: float = Field(
        0.05,
        ge=0,
        description="Episode reward a version may lose: it fails when the difference's interval "
        "is wholly below -margin, passes when wholly above.",
    )
    gate_eval_margin: float = Field(
        0.02,
        ge=0,
        description="Score a version may lose on any eval set against the current version's "
        "before it fails.",
    )
    gate_min_weight: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="A version whose mean importance weight on the logged episodes is under this "
        "puts its probability where nothing was logged: it fails.",
    )
    gate_fallback: Literal["publish", "canary", "reject"] = Field(
        "publish",
        description="What an inconclusive gate does (too few logged episodes yet, an interval "
        "across -margin, no eval sets): publish as without a gate (a canary, if canaries are on), "
        "open a canary whatever canary_fraction says (on gate_canary_fraction if it is 0; the "
        "other canary_* settings decide it), or reject.",
    )
    gate_canary_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="With gate_fallback=canary and canaries off: the share of the lineage's "
        "episodes an undecided version serves until its reward decides.",
    )

    _split = field_validator(
        "vllm", "agents", "tenants", "lineages", "lora_targets", mode="before"
    )(split_commas)

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, spec: object, info: ValidationInfo) -> object:
        """A GGUF file, a packaged model or a hub id becomes the directory it converts to."""
        if not isinstance(spec, str | Path):
            return spec
        try:
            return models.resolve(spec, Path(info.data.get("home", ".flywheel")))
        except models.ModelNotFound as e:
            raise ValueError(str(e)) from e

    @property
    def estimates(self) -> bool:
        """Whether each new version is estimated from logged traffic (`ope` or `gate`)."""
        return self.ope != "off" or "ope" in self.gate

    @property
    def asks_evals(self) -> bool:
        """Whether each new version is asked the lineage's eval sets (`evals` or `gate`)."""
        return self.evals != "off" or "evals" in self.gate

    @property
    def shares_prompts(self) -> bool:
        """`share_prompts`, where it can work (not under checkpointing or FSDP2)."""
        return self.share_prompts and not self.gradient_checkpointing and not self.shard_base

    @property
    def lora_modules(self) -> list[str]:
        """`lora_targets`, or the architecture's default."""
        return self.lora_targets or models.lora_targets(self.model)

    _lineage = field_validator("lineage")(naming.check_lineage)

    @field_validator("lineages")
    @classmethod
    def _check_lineages(cls, lineages: list[str]) -> list[str]:
        for name in lineages:
            naming.check_lineage(name.replace("*", "x"))  # a pattern: `*` for any part
        if len(set(lineages)) != len(lineages):
            raise ValueError(f"lineages named twice: {','.join(lineages)}")
        return lineages

    def trained_lineages(self) -> list[TrainerSettings]:
        """The settings of each lineage this process trains (`lineages`, else `lineage`)."""
        return [self.for_lineage(n) for n in self.lineages or [self.lineage] if "*" not in n]

    def for_lineage(self, lineage: str) -> TrainerSettings:
        """These settings for one lineage: a tenant's lineage trains on that tenant's calls only."""
        owner = naming.tenant_of_lineage(lineage)
        if owner is not None and self.tenants not in ([], [owner]):
            raise ValueError(
                f"lineage {lineage!r} is tenant {owner!r}'s: it trains on that tenant's "
                f"calls only, not on tenants {','.join(self.tenants)}"
            )
        tenants = [owner] if owner is not None else self.tenants
        return self.model_copy(update={"lineage": lineage, "lineages": [], "tenants": tenants})

    @field_validator("vllm")
    @classmethod
    def _check_vllm(cls, urls: list[str]) -> list[str]:
        if not urls:
            raise ValueError("give at least one --vllm URL (or FLYWHEEL_VLLM)")
        return vllm_base_urls(urls, "vllm")

    @property
    def canary_rule(self) -> canary.Rule | None:
        if self.canary_fraction == 0:
            return None
        return self.gate_canary_rule

    @property
    def gate_canary_rule(self) -> canary.Rule:
        """The canary an undecided version opens with gate_fallback=canary (the configured one,
        on gate_canary_fraction when canaries are off)."""
        return canary.Rule(
            fraction=self.canary_fraction or self.gate_canary_fraction,
            min_episodes=self.canary_min_episodes,
            alpha=self.canary_alpha,
            margin=self.canary_margin,
            max_s=self.canary_max_s,
            fallback=self.canary_fallback,
        )

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainerSettings:
        if self.lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"lora_rank must be one vLLM accepts: {VLLM_LORA_RANKS}")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(
                "backoff_max_s must be at least backoff_s: raise it or lower backoff_s"
            )
        if self.load_in_4bit and self.shard_base:
            raise ValueError(
                "load_in_4bit and shard_base do not go together: FSDP2 would turn the 4-bit "
                "weights into plain ones; shard a bfloat16 base, or quantise it on one device"
            )
        if self.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("load_in_4bit needs bitsandbytes: pip install bitsandbytes")
        if not self.lora_targets:
            try:
                models.lora_targets(self.model)
            except models.ModelNotFound as e:
                raise ValueError(str(e)) from e
        self.trained_lineages()  # a tenant's lineage trains on its calls only
        owner = naming.tenant_of_lineage(self.lineage)
        if owner is not None and not self.lineages:
            self.tenants = [owner]
        return self
