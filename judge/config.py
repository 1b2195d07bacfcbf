"""Settings of the judge process (`flywheel judge`), built once at start-up and passed down.
Every field is also a `FLYWHEEL_*` environment variable; lists are comma-separated there."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from core.settings import DatabaseSettings, split_commas


class JudgeSettings(DatabaseSettings):
    judge_model: str = Field(
        ...,
        min_length=1,
        description="The judge, as a litellm model string: openai/gpt-4.1-mini, "
        "anthropic/claude-..., hosted_vllm/NAME (with FLYWHEEL_JUDGE_API_BASE), ...",
    )
    judge_api_base: str | None = Field(
        None, description="The judge's base URL (an OpenAI-compatible server, a vLLM)."
    )
    judge_api_key: SecretStr | None = Field(
        None, description="The judge's key; unset: litellm reads the provider's own variable."
    )
    judge_proxy: str = Field(
        "http://127.0.0.1:8000", description="The Flywheel proxy its rewards are posted to."
    )
    judge_key: SecretStr | None = Field(
        None,
        description="A key of the tenant it judges, with the `reward` scope (unset: auth off).",
    )
    judge_tenant: str | None = Field(
        None, description="Whose episodes it judges (its key's tenant); unset: the default one."
    )
    judge_tasks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Only tasks matching these patterns (fnmatch, e.g. sql-*); empty: every task.",
    )
    judge_rubrics: Path | None = Field(
        None,
        description='A JSON file {"task pattern": "rubric", ...}: what a good episode of those '
        "tasks does (the first pattern that matches wins; none: the default rubric).",
    )
    judge_grace_s: float = Field(
        600.0,
        ge=0,
        description="An episode is judged once its last call is this old and it still has no "
        "final reward (the application's own reward always comes first).",
    )
    judge_group_size: int = Field(
        8, ge=1, le=32, description="Most episodes of one task ranked in one judge call."
    )
    judge_min_group: int = Field(
        2, ge=1, description="Fewer due episodes of a task wait for more (ranking needs peers)..."
    )
    judge_alone_after_s: float = Field(
        3600.0, ge=0, description="...until the oldest has waited this long past its grace."
    )
    judge_concurrency: int = Field(4, ge=1, description="Judge calls in flight at once.")
    judge_rpm: float | None = Field(
        None, gt=0, description="Most judge calls started a minute (a provider's rate limit)."
    )
    judge_retries: int = Field(
        3, ge=0, description="Retries of a failed judge call (litellm's, with backoff)."
    )
    judge_attempts: int = Field(
        3, ge=1, description="Groups an episode may be judged in before it is left unjudged."
    )
    judge_timeout_s: float = Field(120.0, gt=0, description="One judge call's time limit.")
    judge_poll_s: float = Field(10.0, gt=0, description="How often due episodes are looked for.")
    judge_max_chars: int = Field(
        6000, ge=200, description="Each episode's transcript is cut to this many characters."
    )
    judge_response_format: Literal["json_schema", "json_object", "regex", "none"] = Field(
        "json_schema",
        description="How the judge is held to the answer's JSON shape: a schema (OpenAI, vLLM's "
        "guided decoding), JSON mode, only the prompt, or `regex`: vLLM's structured outputs "
        "held to the compact answer by a regular expression (a small local judge model, which a "
        "schema leaves room to ramble in whitespace).",
    )
    judge_input_cost_per_token: float | None = Field(
        None, ge=0, description="USD, for a model litellm has no price for (a local one)."
    )
    judge_output_cost_per_token: float | None = Field(None, ge=0, description="USD, likewise.")

    _split = field_validator("judge_tasks", mode="before")(split_commas)
