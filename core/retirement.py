"""Retiring old adapter versions (core/policy.py's lifecycle, its last step): which versions of a
lineage are marked retired. The trainer's housekeeping (trainer/housekeeping.py) then unloads them
from every vLLM after the grace and deletes their directories."""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core import locks
from core.locks import Lock
from core.tables import AdapterVersion
from core.tables import Canary as CanaryRow


def mark_retired(*, session: Session, lineage: str, keep: int) -> None:
    """Retire every version of `lineage` but its newest `keep`, its current one and an open
    canary's candidate (they stay loadable). The other lineages are not touched."""
    locks.hold(Lock.PUBLISH, session=session)  # as every move of the lineage's versions
    newest = (
        select(AdapterVersion.version)
        .where(AdapterVersion.lineage == lineage)
        .order_by(AdapterVersion.version.desc())
        .limit(keep)
    )
    session.execute(
        update(AdapterVersion)
        .where(
            AdapterVersion.lineage == lineage,
            AdapterVersion.retired_at.is_(None),
            AdapterVersion.is_current.is_(False),
            AdapterVersion.version.not_in(newest.scalar_subquery()),
            AdapterVersion.version.not_in(
                select(CanaryRow.candidate).where(CanaryRow.decided_at.is_(None))
            ),
        )
        .values(retired_at=func.now())
    )
