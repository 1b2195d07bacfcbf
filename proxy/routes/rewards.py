"""POST /v1/rewards: validate, wait for the transitions the rewards name, store them all or none.

A step reward names its transition (`transition_id`, from the X-Transition-Id header) or a tool
call the transition made (`tool_call_id`: what a framework that ran the tool knows); `source`
says who gave it ("tool" for a failed tool run, say; "air" is the proxy's own, proxy/record/air.py).

A reward for an episode whose transitions are still in this process's writer queue waits for them
(`Recorder.wait_stored`), so a reward posted after its completion's response always joins it. A
step reward whose transition another replica recorded and has not stored yet is kept "pending"
and joins its transition when that replica's writer stores it (`rewards.attach_pending_rewards`).

Postgres unreachable or refusing (not as data), or the writer's journal not replayed yet: a valid
post is journaled behind the transitions (fsync'd) and answered 202 with `"status": "journaled"`,
`"stored": false`; the writer applies it when the journal is replayed
(proxy/record/reward_journal.py). Validation is the same either way: a bad post is a 4xx at once.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from core.database import is_outage, write_deadline
from core.tenants import DEFAULT, Principal
from proxy import metrics
from proxy.auth import principal_of
from proxy.errors import ApiError
from proxy.record import reward_journal
from proxy.record.recorder import STORED_WAIT_S
from proxy.record.schemas import MAX_REWARDS_PER_POST, RewardIn
from proxy.record.storable import pg_safe
from proxy.record.store import rewards
from proxy.routes.body import items as body_items
from proxy.routes.body import read_json
from proxy.services import Services, ServicesDep

router = APIRouter()
# A reward's status in a 202: in the journal, applied (and its status known) at replay.
JOURNALED = "journaled"
# While a reward waits for its transitions: how often it looks whether the writer is journaling.
OUTAGE_CHECK_S = 0.25


# The body is read by hand (read_json: size limit, U+0000, clear errors); this documents it.
_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "oneOf": [
                    RewardIn.model_json_schema(),
                    {
                        "type": "array",
                        "items": RewardIn.model_json_schema(),
                        "minItems": 1,
                        "maxItems": MAX_REWARDS_PER_POST,
                    },
                ]
            }
        }
    },
}


@router.post(
    "/v1/rewards",
    openapi_extra={"requestBody": _BODY},
    responses={
        202: {
            "description": "Journaled (Postgres unreachable or refusing): the same shape, "
            'with "status": "journaled" and "stored": false; applied when the journal is replayed'
        }
    },
)
async def post_rewards(request: Request, services: ServicesDep) -> Response:
    body, nul = await read_json(request, services.settings.max_body_bytes)
    principal = principal_of(request.scope)
    status, out = await store_rewards(pg_safe(body) if nul else body, services, principal)
    return Response(orjson.dumps(out), status_code=status, media_type="application/json")


async def store_rewards(
    body: Any, services: Services, principal: Principal = DEFAULT
) -> tuple[int, dict[str, Any]]:
    """Store every reward of the body or none (200), or journal them all (202: Postgres cannot
    take them now); episode ids are the caller's (its tenant's)."""
    posted_at = time.time()  # the last posted final reward wins, however late it is applied
    items = parse_rewards(body)
    if principal.tenant is not None:  # the tenant's own episodes (core/tenants.py)
        items = [r.model_copy(update={"episode_id": principal.own(r.episode_id)}) for r in items]
    # Keyed before the first attempt: a live write whose COMMIT lands unseen (timed out below)
    # is journaled, and its replay must find it a duplicate, not store it again.
    items = reward_journal.keyed(items)
    recorder = services.recorder
    if not recorder.database_up:
        # The writer is journaling (Postgres was unreachable moments ago) or replaying: the
        # rewards go behind its transitions, so that replay keeps their order and their keys'.
        return journaled(items, body, services, principal, posted_at)
    by_episode: dict[str, list[RewardIn]] = {}
    for r in items:
        by_episode.setdefault(r.episode_id, []).append(r)
    for episode_id, mine in by_episode.items():
        step_ids = [str(r.transition_id) for r in mine if r.transition_id is not None]
        # A tool call id may be any of the episode's transitions: wait for all of them.
        by_call = any(r.tool_call_id is not None for r in mine)
        wanted = None if by_call else step_ids or None
        stored = await _wait_stored(services, episode_id, wanted)
        if not stored and not recorder.database_up:  # Postgres went away meanwhile
            return journaled(items, body, services, principal, posted_at)
        if not stored and (step_ids or by_call):
            raise ApiError(
                503,
                "the transitions of this reward are not stored yet "
                "(Postgres unreachable?); retry with the same idempotency_key",
                type="service_unavailable",
                code="not_stored_yet",
            )
    try:
        # Bounded like the writer's writes: a partition holds a pooled connection for libpq's
        # 10 s and a new one for 5 s more, a frozen server for as long as it is frozen; the
        # rewards are journaled instead (bench/chaos.py, tests/proxy/record/test_hung_postgres.py).
        async with (
            write_deadline(services.settings.writer_write_timeout_s),
            services.reward_sessions.begin() as session,  # their own pool: not the writer's
        ):
            try:
                saved = await rewards.add_rewards(
                    items,
                    session=session,
                    gamma=services.settings.credit_gamma,
                    posted_at=[posted_at] * len(items),
                )
            except rewards.UnknownTransition as e:
                raise ApiError(
                    404, str(e), param="transition_id", code="transition_not_found"
                ) from e
            except rewards.AmbiguousToolCall as e:
                raise ApiError(409, str(e), param="tool_call_id", code="ambiguous_tool_call") from e
            except rewards.RewardConflict as e:
                raise ApiError(409, str(e), code="already_trained") from e
            except rewards.KeyReused as e:
                raise ApiError(
                    409, str(e), param="idempotency_key", code="idempotency_key_reused"
                ) from e
    except Exception as e:
        if not is_outage(e):  # (a refusal above is an ApiError: not an outage)
            raise
        # Unreachable, or refusing for a reason of its own (a read-only standby): the rewards
        # wait in the journal. (Had the commit gone through unseen, each reward replays as a
        # duplicate of itself: every one has a key by now.)
        return journaled(items, body, services, principal, posted_at)
    results = []
    for r, s in zip(items, saved, strict=True):
        results.append(_result(r, principal, s.transition_id, s.status, s.credited))
        metrics.rewards_ingested.labels(_kind(r), s.status).inc()
    return 200, _shaped(body, results)


async def _wait_stored(services: Services, episode_id: str, wanted: list[str] | None) -> bool:
    """`Recorder.wait_stored`, given up once the writer journals: the transitions will not be
    stored before Postgres is back, and the reward goes behind them in the journal at once."""
    recorder = services.recorder
    deadline = time.monotonic() + STORED_WAIT_S
    while recorder.database_up:
        remaining = deadline - time.monotonic()
        if await recorder.wait_stored(
            episode_id, wanted, timeout=max(0.0, min(OUTAGE_CHECK_S, remaining))
        ):
            return True
        if remaining <= OUTAGE_CHECK_S:
            return False
    return False


def journaled(
    items: list[RewardIn], body: Any, services: Services, principal: Principal, posted_at: float
) -> tuple[int, dict[str, Any]]:
    """202: the rewards are in the journal (fsync'd), to be applied when it is replayed."""
    if not services.recorder.journal_rewards(reward_journal.journal_entry(items, posted_at)):
        raise ApiError(
            503,
            "database unavailable and the journal failing "
            f"({services.recorder.journal_error}); nothing was stored, "
            "retry with the same idempotency_key",
            type="service_unavailable",
            code="database_unavailable",
        )
    for r in items:
        metrics.rewards_ingested.labels(_kind(r), JOURNALED).inc()
    return 202, _shaped(body, [_result(r, principal, r.transition_id, JOURNALED, 0) for r in items])


def _result(
    r: RewardIn, principal: Principal, transition_id: Any, status: str, credited: int
) -> dict[str, Any]:
    return {
        "object": "reward",
        "episode_id": principal.public(r.episode_id),
        "transition_id": str(transition_id) if transition_id else None,
        "reward": r.reward,
        "source": r.source,
        "status": status,
        "stored": status != JOURNALED,
        "credited_transitions": credited,
    }


def _shaped(body: Any, results: list[dict[str, Any]]) -> dict[str, Any]:
    if isinstance(body, dict):
        return results[0]
    return {"object": "list", "data": results}


def _kind(r: RewardIn) -> str:
    return "step" if r.transition_id is not None or r.tool_call_id is not None else "final"


def parse_rewards(body: Any) -> list[RewardIn]:
    items = body_items(
        body, RewardIn, noun="reward", most=MAX_REWARDS_PER_POST, code="invalid_reward"
    )
    keys = [(r.episode_id, r.idempotency_key) for r in items if r.idempotency_key]
    if len(keys) != len(set(keys)):
        raise ApiError(
            400,
            "the same idempotency_key appears twice for one episode in one post",
            param="idempotency_key",
        )
    return items
