"""The wire types of `POST /v1/rewards` and `GET /v1/episodes/{id}` (proxy/routes/rewards.py and
episodes.py), typed. Reading is tolerant: a field the proxy adds later is kept in `raw`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

# "accepted": stored and credited; "duplicate": this idempotency key was stored before (nothing
# changed); "pending": a step reward kept until its transition is stored; "journaled": Postgres
# is down, the proxy has it on disk (answered 202) and applies it when Postgres is back.
RewardStatus = Literal["accepted", "duplicate", "pending", "journaled"]


def new_key() -> str:
    """An idempotency key for one logical reward: made once, sent again on every retry."""
    return f"fw-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Reward:
    """One reward to post: final (no transition_id, no tool_call_id) or for one step."""

    episode_id: str
    value: float
    transition_id: str | None = None  # X-Transition-Id of the call
    tool_call_id: str | None = None  # or the id a tool call's result was sent back with
    source: str | None = None  # who says so, e.g. "tool", "judge", "user"
    idempotency_key: str = field(default_factory=new_key)

    def __post_init__(self) -> None:
        if self.transition_id is not None and self.tool_call_id is not None:
            raise ValueError("a step reward names transition_id or tool_call_id, not both")

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "episode_id": self.episode_id,
            "reward": self.value,
            "idempotency_key": self.idempotency_key,
        }
        for name in ("transition_id", "tool_call_id", "source"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class RewardResult:
    episode_id: str
    value: float
    status: RewardStatus
    stored: bool  # False while journaled: in the proxy's journal, applied at replay
    transition_id: str | None
    source: str | None
    credited_transitions: int

    @property
    def journaled(self) -> bool:
        return self.status == "journaled"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RewardResult:
        return cls(
            episode_id=d["episode_id"],
            value=d["reward"],
            status=d["status"],
            stored=d["stored"],
            transition_id=d.get("transition_id"),
            source=d.get("source"),
            credited_transitions=d.get("credited_transitions", 0),
        )


def reward_results(body: Any) -> list[RewardResult]:
    items = body["data"] if body.get("object") == "list" else [body]
    return [RewardResult.from_json(d) for d in items]


@dataclass(frozen=True)
class Demonstration:
    """A prompt and the answer it should get, for the trainer to imitate (POST
    /v1/demonstrations): `completion` is the answer's text, or an assistant message (with
    `tool_calls`). It trains `lineage`, else the lineage `agent`'s calls are served by."""

    messages: list[dict[str, Any]]
    completion: str | dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    agent: str | None = None
    lineage: str | None = None
    task_id: str | None = None
    episode_id: str | None = None  # where it came from, if anywhere
    idempotency_key: str = field(default_factory=new_key)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "messages": self.messages,
            "completion": self.completion,
            "idempotency_key": self.idempotency_key,
        }
        for name in ("tools", "agent", "lineage", "task_id", "episode_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class DemonstrationResult:
    id: str
    lineage: str
    source: Literal["posted", "episode"]
    status: Literal["created", "duplicate"]  # duplicate: its key (or call) was stored before
    transition_id: str | None  # the recorded call it copies (from an episode)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DemonstrationResult:
        return cls(d["id"], d["lineage"], d["source"], d["status"], d.get("transition_id"))


def demonstration_results(body: Any) -> list[DemonstrationResult]:
    items = body["data"] if body.get("object") == "list" else [body]
    return [DemonstrationResult.from_json(d) for d in items]


@dataclass(frozen=True)
class TransitionView:
    """One recorded call (choice) of an episode; `raw` has every field the proxy sent."""

    id: str
    agent_name: str | None
    task_id: str | None
    route: str
    status: str
    model_used: str | None
    policy_version: int | None  # 0: the base model; None: not the policy
    lineage: str | None
    messages: list[Any]
    text: str | None
    tool_calls: Any
    finish_reason: str | None
    return_: float | None  # the credited return (None until the episode is rewarded)
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TransitionView:
        return cls(
            id=d["id"],
            agent_name=d.get("agent_name"),
            task_id=d.get("task_id"),
            route=d.get("route", ""),
            status=d.get("status", ""),
            model_used=d.get("model_used"),
            policy_version=d.get("policy_version"),
            lineage=d.get("lineage"),
            messages=d.get("messages") or [],
            text=d.get("text"),
            tool_calls=d.get("tool_calls"),
            finish_reason=d.get("finish_reason"),
            return_=d.get("return"),
            raw=d,
        )


@dataclass(frozen=True)
class RewardView:
    """A reward as stored; `transition_id` None: final (or a step still pending)."""

    value: float
    transition_id: str | None
    source: str | None
    idempotency_key: str | None
    pending: dict[str, str] | None
    created_at: str

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RewardView:
        return cls(
            value=d["reward"],
            transition_id=d.get("transition_id"),
            source=d.get("source"),
            idempotency_key=d.get("idempotency_key"),
            pending=d.get("pending"),
            created_at=d.get("created_at", ""),
        )


@dataclass(frozen=True)
class EpisodeView:
    id: str
    task_id: str | None
    final_reward: float | None
    created_at: str
    transitions: list[TransitionView]
    rewards: list[RewardView]
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EpisodeView:
        return cls(
            id=d["id"],
            task_id=d.get("task_id"),
            final_reward=d.get("final_reward"),
            created_at=d.get("created_at", ""),
            transitions=[TransitionView.from_json(t) for t in d.get("transitions", [])],
            rewards=[RewardView.from_json(r) for r in d.get("rewards", [])],
            raw=d,
        )
