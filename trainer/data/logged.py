"""The logged episodes a candidate version is estimated on before it serves (trainer/candidate.py):
the newest rewarded episodes no version learned from, every call of them in order. Functions take
`*, session` and never commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from core.codecs import unpack
from core.tables import PROMPT_IDS_SQL
from core.tenants import TENANT_OF_EPISODE


@dataclass(frozen=True)
class LoggedCall:
    episode_id: str
    task_id: str | None
    final_reward: float
    ours: bool  # served by this lineage: the candidate would have served it
    policy_version: int | None
    step_reward: float  # its own step rewards' sum
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    params: dict[str, Any]
    made_tool_call: bool
    route: str
    id: str = ""  # the transition's: a version's score of it is kept for the next estimate


# The newest rewarded episodes no version learned from, every call of them in order: each of
# the lineage's calls held out (`ope_holdout`), or served by the current `version` and neither
# trained, claimed nor set aside (a candidate trained on an episode would grade itself on it).
_WINDOW = f"""
WITH floor AS (  -- the oldest version whose episodes count (`versions` 0: any, -1)
    SELECT CASE WHEN CAST(:versions AS int) = 0 THEN -1 ELSE coalesce(min(version), -1) END AS v
    FROM (SELECT version FROM adapter_version WHERE lineage = :lineage AND version <= :version
          ORDER BY version DESC LIMIT CAST(:versions AS int)) AS newest
), recent AS (
    SELECT episode_id, max(requested_at) AS at FROM (
        SELECT episode_id, requested_at FROM transition
        WHERE lineage = :lineage AND status = 'ok'
          AND (skip_reason = 'ope_holdout' OR policy_version = :version)
          AND coalesce(policy_version, 0) >= (SELECT v FROM floor)
          AND (CAST(:max_age_s AS float8) = 0
               OR requested_at > now() - make_interval(secs => CAST(:max_age_s AS float8)))
          AND (CAST(:tenants AS text[]) IS NULL
               OR {TENANT_OF_EPISODE} = ANY(CAST(:tenants AS text[])))
        ORDER BY requested_at DESC LIMIT :scan
    ) AS newest GROUP BY episode_id
), window_ AS (
    SELECT e.id, e.task_id, e.final_reward, r.at FROM recent r JOIN episode e ON e.id = r.episode_id
    WHERE e.final_reward IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM transition o WHERE o.episode_id = e.id AND o.lineage = :lineage
          AND (o.status <> 'ok' OR coalesce(o.policy_version, 0) < (SELECT v FROM floor)
               OR o.skip_reason IS DISTINCT FROM 'ope_holdout' AND (
               o.policy_version IS DISTINCT FROM :version OR o.trained_at IS NOT NULL
               OR o.skip_reason IS NOT NULL OR o.claim_expires_at > now())))
    ORDER BY r.at DESC LIMIT :episodes
)
SELECT t.episode_id, w.task_id, w.final_reward, t.lineage IS NOT DISTINCT FROM :lineage AS ours,
       t.policy_version,
       (SELECT coalesce(sum(r.value), 0.0) FROM reward r WHERE r.transition_id = t.id)
           AS step_reward,
       {PROMPT_IDS_SQL.format(row="t")} AS prompt_token_ids, t.completion_token_ids, t.logprobs,
       t.params, (jsonb_typeof(t.tool_calls) = 'array' AND jsonb_array_length(t.tool_calls) > 0)
           IS TRUE AS made_tool_call, t.route, t.id
FROM window_ w JOIN transition t ON t.episode_id = w.id
WHERE t.status = 'ok'
ORDER BY w.at DESC, t.episode_id, t.requested_at, t.choice_index
"""


def window(
    *,
    session: Session,
    lineage: str,
    version: int,
    tenants: list[str],
    episodes: int,
    max_age_s: float = 0.0,
    versions: int = 0,
) -> list[LoggedCall]:
    """Every call of up to `episodes` logged episodes to estimate a candidate on (`_WINDOW`);
    `version` is the lineage's current one; an episode whose newest call is older than
    `max_age_s` is not (0: any age), nor one a call of which an older version served than the
    current one and the `versions` - 1 before it (0: any version)."""
    rows = session.execute(
        text(_WINDOW),
        {
            "lineage": lineage,
            "version": version,
            "tenants": tenants or None,
            "episodes": episodes,
            "scan": 8 * episodes,
            "max_age_s": max_age_s,
            "versions": versions,
        },
    ).mappings()
    return [
        LoggedCall(
            episode_id=r["episode_id"],
            task_id=r["task_id"],
            final_reward=r["final_reward"],
            ours=r["ours"],
            policy_version=r["policy_version"],
            step_reward=float(r["step_reward"]),
            prompt_token_ids=unpack(r["prompt_token_ids"], "i"),
            completion_token_ids=unpack(r["completion_token_ids"], "i"),
            logprobs=unpack(r["logprobs"], "f"),
            params=r["params"] or {},
            made_tool_call=r["made_tool_call"],
            route=r["route"],
            id=str(r["id"]),
        )
        for r in rows
    ]
