"""Canary releases: a new version serves a fraction of its lineage's episodes until the reward
decides between it and the current one.

    open     (trainer's publish, core/policy.py) the candidate is recorded but not made current;
             a `canary` row says candidate, baseline (the current version), fraction, rule
    serve    (every proxy, proxy/relay/alias.py) `policy` for an episode of that lineage goes to the
             candidate when `in_canary(episode, candidate, fraction)`: a hash of the episode id,
             so every call of an episode, on every replica, gets the same version
    decide   (the lineage's trainer, trainer/loop.py) `evidence_rows` -> `weigh` -> `decide` ->
             `policy.decide_canary`: promote (the candidate becomes current) or roll back (it
             is retired: unloaded and deleted)

The test (`weigh`, then `decide`): each arm's rewarded episodes (whose calls of this lineage were
all served by that arm's version); rewards are centred on their task's mean over both arms, so a
task mix that differs between the arms by chance does not decide; then Welch's one-sided t-tests,
only at looks (both arms at min_episodes * 2**k episodes), at level alpha / 2**(k+1) (`weigh`):
    roll back  the candidate is worse:                   p(cand - base < 0)        < level
    promote    the candidate is not worse by the margin: p(cand - base > -margin)  < level
Neither: wait for the next look, up to `max_s`, then the rule's `fallback`.

A *hold* is a canary on no episode (`fraction` 0, `Rule.held`): the promotion gate's fallback for
a version it cannot decide yet (trainer/gate.py). The candidate is loaded, no alias serves it, and
the trainer's gate decides it again on the traffic logged meanwhile (trainer/canary_watch.py):
pass promotes it (or opens a canary on it, when canaries are on), fail retires it; up to `max_s`,
then the rule's `fallback`. Everything else (the trainer pausing, retention keeping the
candidate, a hand on the policy superseding it) is a canary's.

Moving the current version by hand (`policy.make_current`) closes the lineage's open canary as
`superseded`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal, NamedTuple

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from core.stats import welch
from core.tables import AdapterVersion
from core.tables import Canary as CanaryRow

Action = Literal["promote", "rollback"]


@dataclass(frozen=True)
class Rule:
    fraction: float  # of the lineage's episodes the candidate serves (0: a hold)
    min_episodes: int = 30  # rewarded episodes on each arm at the first look
    alpha: float = 0.05  # each one-sided test's level, over all looks together
    margin: float = 0.02  # reward the candidate may lose and still be promoted
    max_s: float = 900.0  # then the fallback decides
    fallback: Action = "promote"

    @property
    def held(self) -> bool:
        """A hold (the promotion gate's `hold` fallback, trainer/gate.py): the candidate is
        loaded but serves no episode, and the gate decides it again on the traffic logged
        meanwhile, not the candidate's own rewards."""
        return self.fraction == 0


@dataclass(frozen=True)
class Canary:
    id: int
    lineage: str
    candidate: int
    candidate_name: str
    baseline: int  # 0: the base model
    fraction: float
    rule: Rule
    opened_at: datetime
    age_s: float  # by the database's clock, when read

    def serving(self) -> str:
        """What it serves, for logs and `flywheel status`."""
        if self.rule.held:
            return f"{self.candidate_name} held by the gate (serves no episode)"
        return f"{self.candidate_name} on {self.fraction:.0%} of episodes"


class ArmEpisode(NamedTuple):
    """One rewarded episode of an arm."""

    started: float  # when its first call was made, epoch seconds
    task: str | None
    reward: float


@dataclass(frozen=True)
class Evidence:
    candidate_episodes: int  # rewarded so far
    baseline_episodes: int
    candidate_mean: float | None
    baseline_mean: float | None
    # The newest look both arms have reached (None: not yet), the level each test had there,
    # and how many episodes of each arm it used.
    look: int | None = None
    level: float | None = None
    tested: tuple[int, int] | None = None
    p_worse: float | None = None  # H1: the candidate's reward is lower
    p_not_worse: float | None = None  # H1: it is higher than the baseline's minus the margin


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # worse | not_worse | timeout; a hold's: the gate's verdict
    evidence: Evidence | None  # a hold has none: nobody was served its candidate


def in_canary(episode_id: str, candidate: int, fraction: float) -> bool:
    """Whether this episode's calls go to the candidate. The candidate's number is in the hash so
    each canary samples other episodes."""
    digest = hashlib.blake2b(f"{candidate}:{episode_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


# --- the decision ----------------------------------------------------------------------------


def decide(evidence: Evidence, rule: Rule, age_s: float) -> Decision | None:
    """A decision, or None: wait for more episodes."""
    level = evidence.level
    if level is not None and evidence.p_worse is not None and evidence.p_worse < level:
        return Decision("rollback", "worse", evidence)
    if level is not None and evidence.p_not_worse is not None and evidence.p_not_worse < level:
        return Decision("promote", "not_worse", evidence)
    if age_s >= rule.max_s:
        return Decision(rule.fallback, "timeout", evidence)
    return None


def weigh(candidate: list[ArmEpisode], baseline: list[ArmEpisode], rule: Rule) -> Evidence:
    """Each arm's rewarded episodes -> their means, and the two tests at the newest look.

    The trainer looks every few seconds, and a test repeated on growing data until it says yes
    is wrong far more often than its level. So the tests run only at *looks*: look k is the
    moment both arms have `min_episodes * 2**k` episodes, and it tests exactly the episodes that
    began before that moment, at level `alpha / 2**(k+1)`. Between looks the data tested does not
    change (the answer is the same however often it is asked), and the levels of all looks add
    up to `alpha`: whatever the number of looks, each test is wrong with probability at most
    `alpha` (Bonferroni over looks; conservative, and simple enough to check by hand).
    """

    def mean(rows: list[ArmEpisode]) -> float | None:
        return sum(e.reward for e in rows) / len(rows) if rows else None

    counts = (len(candidate), len(baseline), mean(candidate), mean(baseline))
    look, cut = _newest_look(candidate, baseline, rule.min_episodes)
    if look is None:
        return Evidence(*counts)
    c = [e for e in candidate if e.started <= cut]
    b = [e for e in baseline if e.started <= cut]
    # Centred per task, over the tasks both arms have (all of them when nobody sets task ids).
    tasks = {e.task for e in c} & {e.task for e in b}
    task_mean: dict[str | None, float] = {}
    for t in tasks:
        rewards = [e.reward for e in c + b if e.task == t]
        task_mean[t] = sum(rewards) / len(rewards)
    centred_c = [e.reward - task_mean[e.task] for e in c if e.task in task_mean]
    centred_b = [e.reward - task_mean[e.task] for e in b if e.task in task_mean]
    p_worse = p_not_worse = None
    if len(centred_c) >= 2 and len(centred_b) >= 2:
        w = welch(centred_c, centred_b)
        p_worse, p_not_worse = w.p_less(0.0), w.p_greater(-rule.margin)
    level = rule.alpha / 2 ** (look + 1)
    return Evidence(*counts, look, level, (len(c), len(b)), p_worse, p_not_worse)


def _newest_look(
    candidate: list[ArmEpisode], baseline: list[ArmEpisode], min_episodes: int
) -> tuple[int | None, float]:
    """(k, the moment both arms had min_episodes * 2**k episodes), for the largest such k."""
    starts_c = sorted(e.started for e in candidate)
    starts_b = sorted(e.started for e in baseline)
    look, cut, k = None, 0.0, 0
    while min(len(starts_c), len(starts_b)) >= min_episodes * 2**k:
        n = min_episodes * 2**k
        look, cut = k, max(starts_c[n - 1], starts_b[n - 1])
        k += 1
    return look, cut


# --- SQL -------------------------------------------------------------------------------------


def open_canary(
    *, session: Session, lineage: str, candidate: int, baseline: int, rule: Rule
) -> None:
    """Called by `policy.publish` under its lock; the NOTIFY there tells every proxy."""
    session.add(
        CanaryRow(
            lineage=lineage,
            candidate=candidate,
            baseline=baseline,
            fraction=rule.fraction,
            rule=asdict(rule),
        )
    )
    session.flush()


def opened(*, session: Session, lineage: str | None = None) -> dict[str, Canary]:
    """The open canaries, by lineage (of one lineage, or all)."""
    query = (
        select(CanaryRow, AdapterVersion.name, text("extract(epoch FROM now() - canary.opened_at)"))
        .join(AdapterVersion, AdapterVersion.version == CanaryRow.candidate)
        .where(CanaryRow.decided_at.is_(None))
    )
    if lineage is not None:
        query = query.where(CanaryRow.lineage == lineage)
    return {
        row.lineage: Canary(
            row.id,
            row.lineage,
            row.candidate,
            name,
            row.baseline,
            row.fraction,
            Rule(**row.rule),
            row.opened_at,
            float(age),
        )
        for row, name, age in session.execute(query)
    }


def evidence_rows(canary: Canary, *, session: Session) -> tuple[list[ArmEpisode], list[ArmEpisode]]:
    """The rewarded episodes each arm served since the canary opened, as the split assigned
    them: an episode with calls from both (a pin, say) counts for neither, and one served the
    arm its hash does not pick (`policy@N` or an adapter named by hand) is not evidence either. A
    tenant's lineage counts only that tenant's episodes (a shared lineage: its sharers')."""
    tenant = canary.lineage.partition(".")[0] if "." in canary.lineage else None
    rows = session.execute(
        text(
            "SELECT e.id, min(t.policy_version), extract(epoch FROM min(t.requested_at)), "
            "e.task_id, e.final_reward "
            "FROM transition t JOIN episode e ON e.id = t.episode_id "
            "WHERE t.policy_version IN (:candidate, :baseline) AND t.requested_at >= :opened "
            "AND t.lineage = :lineage AND e.final_reward IS NOT NULL "
            "AND (CAST(:prefix AS text) IS NULL OR starts_with(e.id, CAST(:prefix AS text))) "
            "GROUP BY e.id, e.task_id, e.final_reward "
            "HAVING count(DISTINCT t.policy_version) = 1"
        ),
        {
            "candidate": canary.candidate,
            "baseline": canary.baseline,
            "opened": canary.opened_at,
            "lineage": canary.lineage,
            "prefix": None if tenant is None else f"{tenant}/",
        },
    ).all()
    arms: dict[int, list[ArmEpisode]] = {canary.candidate: [], canary.baseline: []}
    for episode, version, started, task, reward in rows:
        assigned = in_canary(episode, canary.candidate, canary.fraction)
        if assigned == (version == canary.candidate):
            arms[version].append(ArmEpisode(float(started), task, float(reward)))
    return arms[canary.candidate], arms[canary.baseline]


def close(
    canary: Canary,
    action: Literal["promote", "rollback", "superseded"],
    reason: str,
    evidence: Evidence | None,
    *,
    session: Session,
) -> bool:
    """Record the decision; False when the canary was closed already (another trainer, a hand).
    `policy.decide_canary` carries it out, under the lock that moves versions."""
    closed = session.execute(
        update(CanaryRow)
        .where(CanaryRow.id == canary.id, CanaryRow.decided_at.is_(None))
        .values(
            decided_at=text("now()"),
            action=action,
            reason=reason,
            evidence=_json(evidence),
        )
        .returning(CanaryRow.id)
    ).first()
    return closed is not None


def _json(evidence: Evidence | None) -> dict[str, Any] | None:
    return asdict(evidence) if evidence else None


EVERY_TENANT = "*"  # not a tenant name (core/tenants.py TENANT_PATTERN)


def history(
    *,
    session: Session,
    lineage: str | None = None,
    limit: int = 100,
    tenant: str | None = EVERY_TENANT,
) -> list[CanaryRow]:
    """The newest canaries first, open and decided; of one tenant's lineages only, unless
    `tenant` is EVERY_TENANT (None: the default tenant's, named without a dot; `acme`: those
    named `acme.*`, as core/policy.py's `tenant_of_lineage` reads a name)."""
    query = select(CanaryRow).order_by(CanaryRow.id.desc()).limit(limit)
    if lineage is not None:
        query = query.where(CanaryRow.lineage == lineage)
    if tenant is None:
        query = query.where(~CanaryRow.lineage.contains("."))
    elif tenant != EVERY_TENANT:
        query = query.where(CanaryRow.lineage.startswith(f"{tenant}.", autoescape=True))
    return list(session.scalars(query))
