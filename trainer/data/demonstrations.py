"""The trainer's SQL for demonstrations (trainer/learner/sft.py trains them): claimed by epoch,
published like a GRPO step's batch, set aside when they cannot be trained. Claims are leases, as
for transitions (store.py). Functions take `*, session` and never commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from core.codecs import unpack
from trainer.data.store import LostClaim, Publication


@dataclass(frozen=True)
class ClaimedDemonstration:
    id: str
    epochs: int  # epochs it has been trained in before this one
    messages: list[Any] | None  # posted: the prompt, tools and answer the chat template renders
    tools: list[Any] | None
    completion: dict[str, Any] | None
    prompt_token_ids: list[int] | None  # copied from a call: its token ids as sampled
    completion_token_ids: list[int] | None


# A lineage's demonstrations still due an epoch (of `epochs`), of the tenants it trains on.
_DUE = """
lineage = :lineage AND skip_reason IS NULL AND epochs < :epochs
  AND (CAST(:tenants AS text[]) IS NULL
       OR coalesce(tenant, 'default') = ANY(CAST(:tenants AS text[])))
"""


def claim(
    *,
    session: Session,
    trainer_id: str,
    lease_s: float,
    lineage: str,
    tenants: list[str],
    epochs: int,
    limit: int,
    max_attempts: int,
) -> list[ClaimedDemonstration]:
    """Claim up to `limit` demonstrations due an epoch, the fewest epochs first (an epoch goes
    round every demonstration before the next begins), oldest first. Those that have used up
    their attempts are set aside as `train_failed`."""
    rows = (
        session.execute(
            text(
                "SELECT id::text AS id, epochs, messages, tools, completion, prompt_token_ids, "
                f"completion_token_ids, train_attempts FROM demonstration WHERE {_DUE} "
                "AND (claim_expires_at IS NULL OR claim_expires_at < now()) "
                "ORDER BY epochs, created_at, id LIMIT :limit FOR UPDATE SKIP LOCKED"
            ),
            {"lineage": lineage, "epochs": epochs, "tenants": tenants or None, "limit": limit},
        )
        .mappings()
        .all()
    )
    failed = [r["id"] for r in rows if r["train_attempts"] >= max_attempts]
    if failed:
        set_aside(dict.fromkeys(failed, "train_failed"), session=session)
    rows = [r for r in rows if r["train_attempts"] < max_attempts]
    if rows:
        session.execute(
            text(
                "UPDATE demonstration SET claimed_by = :me, train_attempts = train_attempts + 1, "
                "claim_expires_at = now() + make_interval(secs => :lease) "
                "WHERE id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"me": trainer_id, "lease": lease_s, "ids": [r["id"] for r in rows]},
        )
    return [
        ClaimedDemonstration(
            id=r["id"],
            epochs=r["epochs"],
            messages=r["messages"],
            tools=r["tools"],
            completion=r["completion"],
            prompt_token_ids=unpack(r["prompt_token_ids"], "i"),
            completion_token_ids=unpack(r["completion_token_ids"], "i"),
        )
        for r in rows
    ]


def due(*, session: Session, lineage: str, tenants: list[str], epochs: int) -> int:
    """Demonstrations of the lineage still due an epoch (claimed or not)."""
    return int(
        session.execute(
            text(f"SELECT count(*) FROM demonstration WHERE {_DUE}"),
            {"lineage": lineage, "epochs": epochs, "tenants": tenants or None},
        ).scalar_one()
    )


def finish(
    *,
    session: Session,
    trainer_id: str,
    trained: list[str],
    skipped: dict[str, str],
    publication: Publication,
) -> None:
    """Make `version` current (or the lineage's canary) and count an epoch for each trained
    demonstration; LostClaim if another trainer holds some of them now."""
    done = session.execute(
        text(
            "UPDATE demonstration SET epochs = epochs + 1, trained_at = now(), "
            "trained_version = :v, train_attempts = 0, claimed_by = NULL, "
            "claim_expires_at = NULL WHERE id = ANY(CAST(:ids AS uuid[])) AND claimed_by = :me "
            "RETURNING id"
        ),
        {"ids": trained, "me": trainer_id, "v": publication.version},
    ).all()
    if len(done) != len(trained):
        raise LostClaim(
            f"{len(trained) - len(done)} of {len(trained)} demonstrations were taken over"
        )
    set_aside(skipped, session=session)
    publication.publish(session=session, trained_transitions=0)


def set_aside(skipped: dict[str, str], *, session: Session) -> None:
    """Demonstrations that will never be trained, and why (template_error, too_long, ...)."""
    for reason in sorted(set(skipped.values())):
        session.execute(
            text(
                "UPDATE demonstration SET skip_reason = :reason, claimed_by = NULL, "
                "claim_expires_at = NULL WHERE id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"reason": reason, "ids": [i for i, r in skipped.items() if r == reason]},
        )
