"""What became of the recorded calls: the share that became training data, and why the rest did
not, with what to change. One classification for `flywheel status`, the dashboard's overview and
the tests, so an operator reads the same words everywhere.

Every recorded call has one fate, decided in this order (`FATE_SQL`): trained; set aside by the
trainer (its `skip_reason`); routed to a provider (no token ids); failed; not served by a policy
lineage (a model named directly); waiting for its reward; credited and waiting for a trainer
(queued). The trainable share is trained / decided, where decided leaves out the two waiting
kinds, which may still become training data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FATE_SQL = """CASE
    WHEN {t}.trained_at IS NOT NULL THEN 'trained'
    WHEN {t}.skip_reason IS NOT NULL THEN {t}.skip_reason
    WHEN {t}.provider IS NOT NULL THEN 'routed'
    WHEN {t}.status <> 'ok' THEN 'failed_call'
    WHEN {t}.lineage IS NULL THEN 'not_the_policy'
    WHEN {t}.credited_at IS NULL THEN 'awaiting_reward'
    ELSE 'queued' END"""

WAITING = ("awaiting_reward", "queued")

# fate -> (what it means, what to change). Unknown fates (a reason added later) show as they are.
REASONS: dict[str, tuple[str, str]] = {
    "trained": ("became training data", ""),
    "queued": ("rewarded, waiting for a trainer", "a trainer of its lineage claims it"),
    "awaiting_reward": (
        "no reward yet",
        "post one to POST /v1/rewards (it is trained if it comes within FLYWHEEL_MAX_AGE_S)",
    ),
    "greedy": (
        "at temperature 0",
        "greedy calls carry no exploration and cannot be trained; sample at temperature > 0",
    ),
    "constrained_decoding": (
        "decoded to a grammar by vLLM",
        "response_format, tool_choice required/named and calls to strict tools are held to a "
        "grammar the trainer cannot reproduce; declare tools non-strict with tool_choice auto",
    ),
    "unsupported_sampling": (
        "sampled with settings the trainer does not reproduce",
        "min_tokens, bad_words, beam search, best_of and custom logits processors: leave them out",
    ),
    "too_old": ("rewarded too late", "rewards older than FLYWHEEL_MAX_AGE_S are not trained"),
    "stale": ("too many versions old", "raise FLYWHEEL_MAX_STALENESS"),
    "missing_logprobs": (
        "without behaviour logprobs",
        "vLLM gave none (a Responses function-call output sampled other than at temperature 1 "
        "without truncation cannot be scored)",
    ),
    "missing_token_ids": ("without token ids", "the upstream returned none"),
    "too_long": ("longer than the model's context", "shorten prompts or max_tokens"),
    "token_out_of_vocab": ("from another base model", "train the model that served them"),
    "not_the_policy": (
        "not served by a trained lineage",
        "call model `policy` (or policy@N) to have a call trained",
    ),
    "ungrouped": (
        "alone in its task",
        "tag X-Task-Id so attempts form a group, or set FLYWHEEL_UNGROUPED=baseline",
    ),
    "no_signal": (
        "in a task group whose every attempt earned the same",
        "nothing to learn from; FLYWHEEL_FLAT_GROUPS=train trains them anyway",
    ),
    "train_failed": ("failed the training step repeatedly", "see the trainer's log"),
    "ope_holdout": (
        "kept out of training to estimate new versions on",
        "FLYWHEEL_OPE_HOLDOUT sets the share while FLYWHEEL_OPE is on",
    ),
    "routed": ("answered by a provider (FLYWHEEL_ROUTES)", "provider calls have no token ids"),
    "failed_call": ("failed or aborted", "nothing to learn from a call that did not finish"),
}


@dataclass
class Share:
    """The calls of one window (and one lineage, or all) by fate."""

    calls: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    @property
    def trained(self) -> int:
        return self.calls.get("trained", 0)

    @property
    def waiting(self) -> int:
        return sum(self.calls.get(f, 0) for f in WAITING)

    @property
    def decided(self) -> int:
        return self.total - self.waiting

    @property
    def ratio(self) -> float | None:
        """Trained / decided (None: nothing decided yet)."""
        return self.trained / self.decided if self.decided else None

    def not_trained(self) -> list[tuple[str, int]]:
        """The decided calls that did not become training data, most first."""
        rest = [(f, n) for f, n in self.calls.items() if f != "trained" and f not in WAITING]
        return sorted(rest, key=lambda fn: -fn[1])


def explain(fate: str, calls: int) -> str:
    """One line for an operator: "412 calls at temperature 0: greedy calls ...; sample at ..."."""
    meaning, fix = REASONS.get(fate, (fate.replace("_", " "), ""))
    return f"{calls} call{'s' * (calls != 1)} {meaning}" + (f": {fix}" if fix else "")


def fates_sql(where: str) -> str:
    """Calls by fate and lineage, for the transitions `t` matching `where` (a window, a tenant's
    episodes): rows (fate, lineage, calls) for `shares`. Reads the index on requested_at."""
    return (
        f"SELECT {FATE_SQL.format(t='t')} AS fate, t.lineage, count(*) AS calls "
        f"FROM transition t WHERE {where} GROUP BY 1, 2"
    )


def shares(rows: list[tuple[str, str | None, int]]) -> tuple[Share, dict[str, Share]]:
    """All calls, and each lineage's, from `fates_sql` rows."""
    everything, by_lineage = Share(), dict[str, Share]()
    for fate, lineage, calls in rows:
        everything.calls[fate] = everything.calls.get(fate, 0) + int(calls)
        if lineage is not None:
            mine = by_lineage.setdefault(lineage, Share())
            mine.calls[fate] = mine.calls.get(fate, 0) + int(calls)
    return everything, by_lineage
