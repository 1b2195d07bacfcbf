"""A big table of recorded traffic in seconds: synthetic episodes, their calls, messages and
rewards, inserted by SQL as the proxy would have stored them. bench/dashboard.py, export.py,
retention.py and judge.py measure on it.

`fill()` makes the daily partitions first (as the proxy makes them ahead), then episodes of 4 calls
(agents `agent-0` .. `agent-3`) over 50 tasks, starting evenly over the last `days` (the newest
ending a second ago). Each call names a shared system message and a question (its task's, or its
episode's own), stored once and marked used on the last day that asked it, as the writer marks
them; with `token_ids`, 300 prompt and 12 completion ids and logprobs. A rewarded episode has its
final reward (and its reward row), its calls their return; agent-0's call has a step reward of
-0.5 from AIR.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Literal

import psycopg

from core import database, partitions

CALLS_PER_EPISODE = 4
TASKS = 50
PROMPT_IDS, COMPLETION_IDS = 300, 12


def fill(
    url: str,
    episodes: int,
    *,
    days: float = 1.0,
    token_ids: bool = True,
    question: Literal["task", "episode"] = "task",
    rewarded: float = 1.0,
    tenant: bool = False,
    versions: int = 1,
    trained_after_h: float | None = None,
    failed: float = 0.0,
    set_aside: float = 0.0,
) -> None:
    """`episodes` episodes of CALLS_PER_EPISODE calls into the database at `url`.

    question: whose question each call asks ("task": calls of one task and agent form a group).
    rewarded: the share of episodes with a final reward (0.9: every tenth has none).
    tenant: every tenth episode is the tenant `acme`'s, stored as `acme/<id>`, as the proxy does.
    versions: policy versions one after another over the days (v1 oldest), each call's own.
    trained_after_h: rewarded calls of episodes older than this were trained (a minute after).
    failed, set_aside: the shares of failed calls and of calls the trainer set aside ("stale").
    Prints how long it took.
    """
    started = time.perf_counter()
    engine, _ = database.create_sessions(url)
    back = math.ceil(days)
    today = datetime.now(UTC).date()
    partitions.ensure(engine, today=today - timedelta(days=back), ahead=back + 2)
    engine.dispose()
    key = {"task": "task_id", "episode": "id"}[question]
    values = {
        "n": episodes,
        "span": days * 86400,
        "calls": CALLS_PER_EPISODE,
        "tasks": TASKS,
        "rewarded": rewarded,
        "tenant": tenant,
        "versions": versions,
        "trained_after_s": None if trained_after_h is None else trained_after_h * 3600,
        "failed": failed,
        "set_aside": set_aside,
        "ids": token_ids,
        "p": PROMPT_IDS,
        "c": COMPLETION_IDS,
    }
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(EPISODES, values)
        conn.execute(MESSAGES.format(key=key))
        conn.execute(TRANSITIONS.format(key=key), values)
        conn.execute(REWARDS)
        conn.execute("ANALYZE")
    seconds = time.perf_counter() - started
    print(f"filled {episodes * CALLS_PER_EPISODE:,} transitions in {seconds:.0f} s")


EPISODES = """
INSERT INTO episode (id, task_id, created_at, final_reward, final_reward_at, last_call_at)
SELECT t.prefix || 'ep-' || n, t.prefix || 'task-' || (n %% %(tasks)s), a.at,
       CASE WHEN n %% 10 < %(rewarded)s * 10 THEN random() END,
       CASE WHEN n %% 10 < %(rewarded)s * 10 THEN now() END,
       a.at + make_interval(secs => %(calls)s - 1)
FROM generate_series(1, %(n)s) AS n
CROSS JOIN LATERAL (
    SELECT CASE WHEN %(tenant)s AND n %% 10 = 0 THEN 'acme/' ELSE '' END AS prefix) t
CROSS JOIN LATERAL (
    SELECT now() - make_interval(secs => %(span)s * (1 - n::float8 / %(n)s) + %(calls)s) AS at
) a"""

MESSAGES = """
INSERT INTO message (digest, body, last_used)
SELECT decode(md5('system'), 'hex'),
       '{{"role": "system", "content": "Answer with a number."}}'::jsonb, current_date
UNION ALL
SELECT decode(md5('user-' || q.key), 'hex'),
       jsonb_build_object('role', 'user', 'content', 'Question of ' || q.key), q.day
FROM (SELECT {key} AS key, max((created_at AT TIME ZONE 'UTC')::date) AS day
      FROM episode GROUP BY 1) q"""

TRANSITIONS = """
INSERT INTO transition (id, episode_id, request_id, choice_index, task_id, agent_name,
    requested_at, route, status, http_status, model_requested, model_used, policy_version,
    lineage, message_digests, params, text, finish_reason, latency_ms, prompt_tokens,
    completion_tokens, prompt_token_ids, completion_token_ids, logprobs, "return", credited_at,
    trained_at, trained_version, skip_reason)
SELECT gen_random_uuid(), e.id, gen_random_uuid(), 0, e.task_id, 'agent-' || k,
    e.created_at + make_interval(secs => k), 'chat',
    CASE WHEN random() < %(failed)s THEN 'failed' ELSE 'ok' END, 200, 'policy',
    'policy-v' || v.version, v.version, 'policy',
    ARRAY[decode(md5('system'), 'hex'), decode(md5('user-' || e.{key}), 'hex')],
    '{{"max_tokens": 16, "temperature": 1.0}}', 'The answer is 42.', 'stop',
    20 + 10 * random(), %(p)s, %(c)s,
    CASE WHEN %(ids)s THEN decode(repeat('07000000', %(p)s), 'hex') END,
    CASE WHEN %(ids)s THEN decode(repeat('09000000', %(c)s), 'hex') END,
    CASE WHEN %(ids)s THEN decode(repeat('cdcc4cbe', %(c)s), 'hex') END,
    e.final_reward, CASE WHEN e.final_reward IS NOT NULL THEN e.created_at END,
    CASE WHEN t.trained THEN e.created_at + interval '1 minute' END,
    CASE WHEN t.trained THEN v.version + 1 END,
    CASE WHEN random() < %(set_aside)s THEN 'stale' END
FROM episode e
CROSS JOIN generate_series(0, %(calls)s - 1) AS k
CROSS JOIN LATERAL (
    SELECT %(versions)s - least(%(versions)s - 1, floor(
        %(versions)s * extract(epoch FROM now() - e.created_at) / %(span)s)::int) AS version) v
CROSS JOIN LATERAL (
    SELECT e.final_reward IS NOT NULL
           AND e.created_at < now() - make_interval(secs => %(trained_after_s)s) AS trained) t"""

REWARDS = """
INSERT INTO reward (episode_id, transition_id, value, source, idempotency_key)
SELECT e.id, NULL, e.final_reward, NULL, NULL FROM episode e WHERE e.final_reward IS NOT NULL
UNION ALL
SELECT t.episode_id, t.id, -0.5, 'air', 'air:' || t.id FROM transition t
WHERE t.agent_name = 'agent-0'"""
