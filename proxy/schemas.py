"""Wire types we own (the OpenAI-compatible routes pass vLLM's types through untouched)."""

from __future__ import annotations

import uuid
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from proxy.config import TAG_PATTERN

MAX_REWARDS_PER_POST = 10_000


class RewardIn(BaseModel):
    """A final reward (no transition_id) or an intermediate reward for one step."""

    model_config = ConfigDict(extra="forbid", strict=True)

    episode_id: Annotated[str, StringConstraints(pattern=TAG_PATTERN)]
    reward: Annotated[float, Field(allow_inf_nan=False)]
    transition_id: Annotated[uuid.UUID | None, Field(strict=False)] = None
    idempotency_key: Annotated[str | None, StringConstraints(min_length=1, max_length=200)] = None
