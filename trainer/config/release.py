"""What a trained version goes through before and after it serves: publishing and retirement,
canary releases, the off-policy estimate, eval sets and the promotion gate."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from core.settings import FlywheelSettings

# The off-policy estimator of a candidate (trainer/ope.py, docs/promotion.md). Here, not there:
# this module is imported by every process's CLI, and trainer/ope.py needs numpy, which the proxy
# image does not have (the first container built from Dockerfile.proxy could not start).
OpeMethod = Literal["wis", "dr"]
OpeResample = Literal["episodes", "tasks"]


class ReleaseSettings(FlywheelSettings):
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
    ope_max_versions: int = Field(
        0,
        ge=0,
        description="Only episodes the current version and the N-1 versions before it served "
        "are estimated on: the fewer versions a logged call is away from the candidate, the "
        "less its weight carries (and clipping cuts). 0: any version.",
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
    ope_resample: OpeResample = Field(
        "episodes",
        description="What a bootstrap draw draws: episodes, or tasks with all their episodes "
        "(honest intervals where the window holds few tasks many times each, as GRPO's "
        "groups make it; wider).",
    )

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
    eval_judge_model: str | None = Field(
        None,
        description="The `judge` scorer's model: its name at eval_judge_url (unset: eval sets "
        "scored by `judge` are not asked, with an error in the log).",
    )
    eval_judge_url: str | None = Field(
        None,
        description="The judge model's OpenAI-compatible server (without /v1: a vLLM, a LiteLLM "
        "proxy, https://api.openai.com); unset: the trainer's first vLLM (its base model, or "
        "an adapter it serves, as the judge).",
    )
    eval_judge_api_key: SecretStr | None = Field(
        None,
        description="Its key (Authorization: Bearer), if it needs one; unset with no URL: the "
        "trainer's FLYWHEEL_VLLM_API_KEY.",
    )
    eval_judge_response_format: Literal["json_schema", "json_object", "regex", "none"] = Field(
        "json_schema",
        description="How the grade is held to its JSON: a JSON schema (OpenAI, vLLM), JSON "
        "mode, vLLM's structured outputs by `regex` (what a small local judge needs), or the "
        "prompt alone.",
    )
    eval_judge_max_chars: int = Field(
        8000, ge=200, description="An item's prompt and answer, cut in the middle past this."
    )

    # --- the promotion gate (trainer/gate.py) ----------------------------------------------
    gate: Literal["off", "ope", "evals", "ope+evals"] = Field(
        "off",
        description="Decide each new version before it serves from its off-policy estimate "
        "(`ope`, made whatever `ope` says; decided before vLLM loads it), its eval sets "
        "(`evals`: asked whatever `evals` says) or both (each must pass): a version that fails is "
        "recorded, retired and never served; training goes on from the current version.",
    )
    gate_evals: Literal["always", "undecided"] = Field(
        "always",
        description="With gate=ope+evals: ask every new version its eval sets, each witness to "
        "pass (`always`), or only a version the estimate cannot decide (too few logged episodes "
        "yet, an interval across -margin), whose eval sets then decide it (`undecided`): the "
        "estimate's cost on most versions, the eval sets' only where the traffic cannot say yet "
        "(no other version is asked them, whatever `evals` says).",
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
    gate_overlap: bool = Field(
        True,
        description="Load a new version into vLLM (under no alias) and ask its eval sets (vLLM's "
        "work) while the off-policy estimate is made (the trainer's): it waits for the slower "
        "of the two instead of both. A version the estimate fails has then been loaded and "
        "asked, though never served; false: the estimate first, and such a version is never "
        "loaded.",
    )
    gate_fallback: Literal["publish", "canary", "hold", "reject"] = Field(
        "publish",
        description="What an inconclusive gate does (too few logged episodes yet, an interval "
        "across -margin, no eval sets): publish as without a gate (a canary, if canaries are on), "
        "open a canary whatever canary_fraction says (on gate_canary_fraction if it is 0; the "
        "other canary_* settings decide it), hold it (loaded, served to no one, the gate asked "
        "again every gate_hold_check_s on the traffic logged meanwhile, training paused), or "
        "reject.",
    )
    gate_hold_check_s: float = Field(
        60.0,
        gt=0,
        description="With gate_fallback=hold: how often the held version's gate is asked again "
        "(each time one forward pass per logged call of the window, as at its publish).",
    )
    gate_hold_max_s: float = Field(
        3600.0,
        gt=0,
        description="With gate_fallback=hold: undecided after this long, gate_hold_timeout "
        "decides.",
    )
    gate_hold_timeout: Literal["reject", "publish"] = Field(
        "reject",
        description="What a hold still undecided after gate_hold_max_s does: reject (only what "
        "the gate passed ships) or publish (as without a gate: current, or a canary if canaries "
        "are on).",
    )
    gate_canary_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="With gate_fallback=canary and canaries off: the share of the lineage's "
        "episodes an undecided version serves until its reward decides.",
    )
