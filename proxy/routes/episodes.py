"""GET /v1/episodes/{id}[?tokens=true]: an episode's transitions (text, tool calls, the return
once credited; token ids and logprobs on request) and its rewards, as JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from core.codecs import unpack
from core.database import OUTAGE_ERRORS
from core.tables import Reward, Transition
from core.tenants import Principal
from proxy.auth import principal_of
from proxy.errors import ApiError, database_error
from proxy.record.recorder import STORED_WAIT_S
from proxy.record.store import episodes
from proxy.services import Services, ServicesDep

router = APIRouter()


@router.get("/v1/episodes/{episode_id}")
async def get_episode(
    episode_id: str, request: Request, services: ServicesDep, tokens: bool = False
) -> Response:
    # Another tenant's episode is not found.
    return await read_episode(principal_of(request.scope), episode_id, services, tokens=tokens)


async def read_episode(
    principal: Principal, episode_id: str, services: Services, *, tokens: bool
) -> Response:
    """The episode as `principal` may see it (the dashboard's episode page reads the same)."""
    stored_id = principal.own(episode_id)
    rows = None
    # Another tenant's episode (the default tenant naming `acme/e1`) is not found either.
    if principal.owns_episode(stored_id):
        # This process's unwritten transitions of the episode first: a read after a call sees it.
        await services.recorder.wait_stored(stored_id, timeout=STORED_WAIT_S)
        try:
            async with services.sessionmaker() as session:
                rows = await episodes.get_episode(stored_id, session=session)
        except OUTAGE_ERRORS as e:
            raise database_error(e, narrow="read it without tokens=true, or retry later") from e
    if rows is None:
        raise ApiError(
            404, f"no episode {episode_id!r}", param="episode_id", code="episode_not_found"
        )
    episode = episode_json(rows, principal.public, tokens)
    return Response(orjson.dumps(episode), media_type="application/json")


def episode_json(
    rows: episodes.EpisodeRows, public: Callable[[str], str], tokens: bool
) -> dict[str, Any]:
    return {
        "id": public(rows.episode.id),
        "object": "episode",
        "task_id": public(rows.episode.task_id) if rows.episode.task_id else None,
        "final_reward": rows.episode.final_reward,
        "created_at": rows.episode.created_at.isoformat(),
        "transitions": [_transition(t, rows, tokens, public) for t in rows.transitions],
        "rewards": [_reward(r) for r in rows.rewards],
    }


def _transition(
    t: Transition, rows: episodes.EpisodeRows, tokens: bool, public: Callable[[str], str]
) -> dict[str, Any]:
    bodies = rows.messages
    out: dict[str, Any] = {
        "id": str(t.id),
        "request_id": str(t.request_id),
        "choice_index": t.choice_index,
        "task_id": public(t.task_id) if t.task_id else None,
        "agent_name": t.agent_name,
        "requested_at": t.requested_at.isoformat(),
        "route": t.route,
        "status": t.status,
        "http_status": t.http_status,
        "model_requested": t.model_requested,
        "model_used": t.model_used,
        "policy_version": t.policy_version,  # 0: the base model; None: not the policy
        "lineage": t.lineage,  # the lineage whose policy served it (model_used: which adapter)
        "messages": [bodies.get(d) for d in t.message_digests],
        "params": t.params,
        "text": t.text,
        "tool_calls": t.tool_calls,
        "tool_errors": t.tool_errors,
        "finish_reason": t.finish_reason,
        "error": t.error,
        "latency_ms": t.latency_ms,
        "usage": {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens},
        "provider": t.provider,  # a provider model's call (FLYWHEEL_ROUTES); None: vLLM
        "cost_usd": t.cost_usd,
        "return": t.return_,
        "credited_at": t.credited_at.isoformat() if t.credited_at else None,
        "trained_at": t.trained_at.isoformat() if t.trained_at else None,
        "trained_version": t.trained_version,
    }
    if tokens:
        out["prompt_token_ids"] = unpack(rows.prompt_ids(t), "i")
        out["completion_token_ids"] = unpack(t.completion_token_ids, "i")
        out["logprobs"] = unpack(t.logprobs, "f")
    return out


def _reward(r: Reward) -> dict[str, Any]:
    return {
        "id": r.id,
        "transition_id": str(r.transition_id) if r.transition_id else None,
        # Not joined to its step yet: that transition (or tool call) is not stored yet.
        "pending": (
            {"transition_id": str(r.pending_transition_id)}
            if r.pending_transition_id
            else {"tool_call_id": r.pending_tool_call_id}
            if r.pending_tool_call_id
            else None
        ),
        "reward": r.value,
        "source": r.source,
        "idempotency_key": r.idempotency_key,
        "created_at": r.created_at.isoformat(),
    }
