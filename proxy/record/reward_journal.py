"""Rewards through an outage: a reward post Postgres cannot take now is journaled (fsync'd, in the
writer's journal, behind the transitions queued before it) and answered 202; the writer's replay
applies it once Postgres answers, after every transition journaled before it
(proxy/record/recorder.py). What Postgres refuses at replay is set aside, never dropped.

- Idempotency across the outage: a reward without a key is given one (`auto:<uuid>`, `keyed`)
  before its first attempt, live or journaled, so neither a replay that repeats it (a crash
  between its commit and the segment's removal) nor the replay of a live write whose COMMIT
  landed unseen (timed out, then journaled) stores it twice. A key posted again during the
  outage, or once during and once after it, is stored once: while anything waits in the journal
  every reward goes there too, in order, and the later one replays as a "duplicate".
- What only Postgres can tell is known at replay: a key reused with another value, a transition of
  another episode, a tool call id several steps share, a return already trained on. The post is
  then applied reward by reward, and each refused one goes to the journal's `rejected/` with the
  reason (`flywheel_rewards_ingested_total{outcome="rejected"}`, and the log); the next start-up
  tries it once more (`Journal.redrive_rejected`).
- Replay applies consecutive posts together, up to REPLAY_BATCH rewards in one transaction (a
  post on its own once a key repeats, or if Postgres refuses the batch): one transaction per post
  replayed ~25,000 posts journaled in a minute's outage under load far slower than they came.
- A reward for an episode not seen yet is what it is when Postgres is up: a final reward is kept
  on the episode's row and credits its transitions when they are stored; a step reward is
  "pending" until its transition is stored.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import orjson

from core.database import OUTAGE_ERRORS, AsyncSessions, refusals_as_outage, write_deadline
from proxy import metrics
from proxy.record.journal import Journal
from proxy.record.schemas import RewardIn
from proxy.record.store.rewards import add_rewards

log = logging.getLogger(__name__)

Entry = dict[str, Any]  # one post as journaled: {"posted_at": unix s, "rewards": [RewardIn JSON]}
REPLAY_BATCH = 1000  # rewards per transaction at replay (a post of 10,000 stays whole)


def keyed(rewards: list[RewardIn]) -> list[RewardIn]:
    """Every reward with an idempotency key: the one it was posted with, else a new one (see
    above). Given once per post, before anything is written."""
    return [
        r if r.idempotency_key else r.model_copy(update={"idempotency_key": f"auto:{uuid.uuid4()}"})
        for r in rewards
    ]


def journal_entry(rewards: list[RewardIn], posted_at: float | None = None) -> Entry:
    """One post as the journal keeps it: every reward with an idempotency key (`keyed`), and
    when it was posted (unix s; default now): at replay a final reward posted before the one
    stored since does not replace it (store/rewards.py `add_rewards`)."""
    posted = [r.model_dump(mode="json") for r in keyed(rewards)]
    return {"posted_at": time.time() if posted_at is None else posted_at, "rewards": posted}


def append(journal: Journal, entry: Entry) -> bool:
    """To disk (fsync'd); False: the journal fails (the caller says 503, nothing kept)."""
    with journal.guard("append"):
        journal.append_rewards([entry])
        metrics.journal_pending.set(journal.pending)
        return True
    return False


async def replay_rewards(
    journal: Journal, sessionmaker: AsyncSessions, *, gamma: float | None, timeout_s: float
) -> bool:
    """Apply the journaled posts older than every transition segment still waiting, in order;
    False when Postgres cannot take them yet (they stay, and the writer tries again later).

    Each post is a segment of its own (fsync'd before its 202): consecutive segments are read
    together, up to REPLAY_BATCH rewards, applied (`batches`), then removed."""
    segments = deque(journal.reward_segments(before=journal.segments()))
    while segments:
        group: list[tuple[Path, list[dict[str, Any]]]] = []
        rewards = 0
        while segments and (not group or rewards < REPLAY_BATCH):
            segment = segments.popleft()
            with journal.guard("read"):
                posts = journal.read_rewards(segment)
            if journal.failing("read"):
                return False
            group.append((segment, posts))
            rewards += sum(len(p["rewards"]) for p in posts if isinstance(p.get("rewards"), list))
        try:
            for batch in batches([post for _, posts in group for post in posts]):
                await _apply_batch(batch, journal, sessionmaker, gamma=gamma, timeout_s=timeout_s)
        except OUTAGE_ERRORS as e:
            log.warning("journaled rewards wait: Postgres cannot take them (%s)", e)
            return False
        for segment, posts in group:
            with journal.guard("remove"):  # a segment left behind replays again: keys make it safe
                journal.remove(segment, len(posts))
        metrics.journal_pending.set(journal.pending)
    return True


def batches(posts: list[Any]) -> list[list[Any]]:
    """Consecutive posts to apply together: at most REPLAY_BATCH rewards (a larger post alone),
    and a new batch where an (episode, key) repeats, so the repeat is judged against the first
    as stored (a duplicate, or a key reused with another value), as it was when posted."""
    out: list[list[Any]] = []
    size, keys = 0, set[tuple[Any, Any]]()
    for post in posts:
        rewards = post.get("rewards") if isinstance(post, dict) else None
        rewards = rewards if isinstance(rewards, list) else []
        mine = {
            (r.get("episode_id"), r.get("idempotency_key")) for r in rewards if isinstance(r, dict)
        }
        if not out or size + len(rewards) > REPLAY_BATCH or keys & mine:
            out.append([])
            size, keys = 0, set()
        out[-1].append(post)
        size += len(rewards)
        keys |= mine
    return out


async def _apply_batch(
    posts: list[Any],
    journal: Journal,
    sessionmaker: AsyncSessions,
    *,
    gamma: float | None,
    timeout_s: float,
) -> None:
    """Several posts in one transaction; if Postgres refuses it (or a post is malformed), its two
    halves, down to the post refused on its own. Raises OUTAGE_ERRORS (the rest then waits)."""
    if len(posts) == 1:
        return await _apply(posts[0], journal, sessionmaker, gamma=gamma, timeout_s=timeout_s)
    try:
        items = [RewardIn.model_validate(r) for post in posts for r in post["rewards"]]
        at = [_posted_at(post) for post in posts for _ in post["rewards"]]
        await _store(items, at, sessionmaker, gamma=gamma, timeout_s=timeout_s)
    except OUTAGE_ERRORS:
        raise
    except Exception:  # one of them is refused: find it by halving, the rest stored in order
        half = len(posts) // 2
        for part in (posts[:half], posts[half:]):
            await _apply_batch(part, journal, sessionmaker, gamma=gamma, timeout_s=timeout_s)
        return
    log.info("%d journaled rewards of %d posts stored", len(items), len(posts))


async def _apply(
    post: dict[str, Any],
    journal: Journal,
    sessionmaker: AsyncSessions,
    *,
    gamma: float | None,
    timeout_s: float,
) -> None:
    """One post, all of it if Postgres takes it; else reward by reward, the refused ones set
    aside. Raises OUTAGE_ERRORS (nothing of it is then stored)."""
    try:
        items = [RewardIn.model_validate(r) for r in post["rewards"]]
        await _store(
            items, [_posted_at(post)] * len(items), sessionmaker, gamma=gamma, timeout_s=timeout_s
        )
    except OUTAGE_ERRORS:
        raise
    except Exception as e:  # refused as data, or not a post at all: not the database's fault
        if isinstance(rewards := post.get("rewards"), list) and len(rewards) > 1:
            for reward in rewards:
                await _apply(
                    {**post, "rewards": [reward]},
                    journal,
                    sessionmaker,
                    gamma=gamma,
                    timeout_s=timeout_s,
                )
            return
        _reject(post, e, journal)
        return
    log.info("%d journaled rewards of one post stored", len(items))


def _posted_at(post: dict[str, Any]) -> float:
    """When the post was made (a line journaled without it, or hand-edited: now)."""
    at = post.get("posted_at")
    return float(at) if isinstance(at, int | float) and not isinstance(at, bool) else time.time()


async def _store(
    items: list[RewardIn],
    posted_at: list[float],
    sessionmaker: AsyncSessions,
    *,
    gamma: float | None,
    timeout_s: float,
) -> None:
    """One transaction for these rewards (both replay paths), counted once committed."""
    async with refusals_as_outage(), write_deadline(timeout_s), sessionmaker.begin() as session:
        saved = await add_rewards(items, session=session, gamma=gamma, posted_at=posted_at)
    for r, s in zip(items, saved, strict=True):
        metrics.rewards_ingested.labels(_kind(r), s.status).inc()


def _reject(post: dict[str, Any], error: Exception, journal: Journal) -> None:
    log.error("a journaled reward was refused at replay (%r); kept in rejected/", error)
    for r in rewards if isinstance(rewards := post.get("rewards"), list) else ():
        metrics.rewards_ingested.labels(_kind(r), "rejected").inc()
    with journal.guard("reject"):
        journal.reject_rewards(post, repr(error))
    if journal.failing("reject"):  # the log is the last place it can go
        log.error("rejected reward post: %s", orjson.dumps(post).decode())


def _kind(reward: Any) -> str:
    """ "step" or "final", for the metric (of a hand-edited line too: it is only counted)."""
    fields = vars(reward) if isinstance(reward, RewardIn) else reward
    if not isinstance(fields, dict):
        return "final"
    step = fields.get("transition_id") is not None or fields.get("tool_call_id") is not None
    return "step" if step else "final"
