"""Wire types we own (the OpenAI-compatible routes pass vLLM's types through untouched)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

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


MAX_DEMONSTRATIONS_PER_POST = 1_000
_LINEAGE = r"^(?:[a-z0-9][a-z0-9_-]{0,31}\.)?[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"  # core/policy.py
Tag = Annotated[str, StringConstraints(pattern=TAG_PATTERN)]


class ChatMessage(BaseModel):
    """A chat message as /v1/chat/completions takes it (other fields kept as given)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None


class Answer(BaseModel):
    """The answer a demonstration teaches: an assistant message (text, tool calls, or both)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> Answer:
        if not (self.content or "").strip() and not self.tool_calls:
            raise ValueError("the answer is empty: give its text or its tool_calls")
        return self


class DemonstrationIn(BaseModel):
    """A prompt (`messages`, and the `tools` it was offered) with the answer it should get
    (`completion`: text, or an assistant message with tool calls); or `from_episode`: every call
    of that recorded episode, its token ids exactly as sampled (keep the best episodes: rejection
    sampling). It trains the lineage `lineage` names, else the one `agent`'s calls are served
    by (as X-Agent-Name decides for a call)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=10_000)] | None = None
    completion: str | Answer | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=1_000)] | None = None
    from_episode: Tag | None = None
    agent: Tag | None = None
    lineage: Annotated[str, StringConstraints(pattern=_LINEAGE)] | None = None
    episode_id: Tag | None = None  # provenance of a posted one (a call's tags, stored the same)
    task_id: Tag | None = None
    idempotency_key: Annotated[str | None, StringConstraints(min_length=1, max_length=200)] = None

    @model_validator(mode="after")
    def _one_kind(self) -> DemonstrationIn:
        posted = self.messages is not None or self.completion is not None or self.tools
        if self.from_episode is not None:
            if posted:
                raise ValueError("give messages and completion, or from_episode, not both")
            return self
        if self.messages is None or self.completion is None:
            raise ValueError("a demonstration needs messages (the prompt) and completion")
        if isinstance(self.completion, str):
            if not self.completion.strip():
                raise ValueError("the completion is empty")
            self.completion = Answer(content=self.completion)
        return self
