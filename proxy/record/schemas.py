"""Wire types we own (the OpenAI-compatible routes pass vLLM's types through untouched)."""

from __future__ import annotations

import uuid
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from proxy.config import TAG_PATTERN

MAX_REWARDS_PER_POST = 10_000
# A reward's magnitude at most: far beyond any score or cost a task gives, and small enough that
# sums of an episode's steps, group statistics (squares) and the dashboard's means stay finite.
MAX_ABS_REWARD = 1e9
AIR_SOURCE = (
    "air"  # the proxy's own intermediate rewards (proxy/record/air.py); clients may not use it
)


class RewardIn(BaseModel):
    """A final reward (no transition_id or tool_call_id) or an intermediate reward for one step,
    named by its transition or by a tool call it made (the id the tool's result was sent with).
    `source` says who gave it, e.g. "tool" for a tool run the client saw fail."""

    model_config = ConfigDict(extra="forbid", strict=True)

    episode_id: Annotated[str, StringConstraints(pattern=TAG_PATTERN)]
    reward: Annotated[float, Field(allow_inf_nan=False, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)]
    transition_id: Annotated[uuid.UUID | None, Field(strict=False)] = None
    tool_call_id: Annotated[str | None, StringConstraints(min_length=1, max_length=200)] = None
    source: Annotated[
        str | None, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
    ] = None
    idempotency_key: Annotated[str | None, StringConstraints(min_length=1, max_length=200)] = None

    @field_validator("source")
    @classmethod
    def _not_air(cls, source: str | None) -> str | None:
        if source == AIR_SOURCE:
            raise ValueError(f"{AIR_SOURCE!r} is the proxy's own source; name yours otherwise")
        return source

    @model_validator(mode="after")
    def _one_step(self) -> RewardIn:
        if self.transition_id is not None and self.tool_call_id is not None:
            raise ValueError("give transition_id or tool_call_id, not both")
        return self
