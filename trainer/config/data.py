"""What a step trains on: when a batch is ready, which agents and tenants, staleness bounds,
claims and retries (trainer/data/), and the demonstrations' supervised steps."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from core.settings import FlywheelSettings, split_commas


class DataSettings(FlywheelSettings):
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

    _split_data = field_validator("agents", "tenants", mode="before")(split_commas)
