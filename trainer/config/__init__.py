"""Settings of the trainer process, built once at start-up and passed down.

One class per concern: `where` (the model, vLLM, adapters, lineages), `data` (what a step trains
on, demonstrations), `learning` (the loss, LoRA, the correction, memory), `release` (publishing,
canaries, the estimate, eval sets, the gate). `TrainerSettings` is all of them with where the
data lives (core/settings.py), and checks what spans two of them.

Every field is also a `FLYWHEEL_*` environment variable and a flag of `flywheel trainer`; lists
are comma-separated in the environment. The documentation site's settings reference is generated
from these classes (docs/reference/settings.md).
"""

from __future__ import annotations

import importlib.util

from pydantic import model_validator

from core import canary, naming
from core.settings import DatabaseSettings
from trainer import models
from trainer.config.data import DataSettings
from trainer.config.learning import LearningSettings, OffPolicyMask
from trainer.config.release import OpeMethod, OpeResample, ReleaseSettings
from trainer.config.where import WhereSettings

__all__ = ["OffPolicyMask", "OpeMethod", "OpeResample", "TrainerSettings"]

# vLLM accepts only these LoRA ranks (--max-lora-rank must be one of them, and >= ours).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# (pydantic takes the fields of the bases last to first: this order is --help's, top to bottom)
class TrainerSettings(
    ReleaseSettings, LearningSettings, DataSettings, WhereSettings, DatabaseSettings
):
    @property
    def estimates(self) -> bool:
        """Whether each new version is estimated from logged traffic (`ope` or `gate`)."""
        return self.ope != "off" or "ope" in self.gate

    @property
    def asks_evals(self) -> bool:
        """Whether each new version is asked the lineage's eval sets (`evals` or `gate`)."""
        return self.evals != "off" or "evals" in self.gate

    @property
    def gate_settles_on_evals(self) -> bool:
        """FLYWHEEL_GATE_EVALS=undecided: the eval sets asked only where the estimate cannot
        decide, and deciding there."""
        return self.gate == "ope+evals" and self.gate_evals == "undecided"

    @property
    def shares_prompts(self) -> bool:
        """`share_prompts`, where it can work (not under checkpointing or FSDP2)."""
        return self.share_prompts and not self.gradient_checkpointing and not self.shard_base

    @property
    def lora_modules(self) -> list[str]:
        """`lora_targets`, or the architecture's default."""
        return self.lora_targets or models.lora_targets(self.model)

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

    @property
    def gate_hold_rule(self) -> canary.Rule:
        """The hold an undecided version is put on with gate_fallback=hold (core/canary.py: a
        canary on no episode, decided by the gate again)."""
        return canary.Rule(
            fraction=0.0,
            max_s=self.gate_hold_max_s,
            fallback="promote" if self.gate_hold_timeout == "publish" else "rollback",
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
        if self.gate_evals == "undecided" and self.gate != "ope+evals":
            raise ValueError(
                "gate_evals=undecided asks the eval sets where the estimate cannot decide: it "
                f"needs gate=ope+evals, not {self.gate}"
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
