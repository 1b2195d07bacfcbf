"""Pins: a lineage held at one version by hand until it is unpinned.

`flywheel adapters pin N` and POST /admin/adapters/N/pin activate N with `policy.make_current(...,
pin=True)`, which calls `hold`; while the pin stands, `policy.publish` raises Pinned (the trainer
waits, its queue kept) and `make_current` too unless it moves the pin. `unpin` lets the trainer go
on from the pinned version. Every write here runs under Lock.PUBLISH, as the policy's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from core import locks
from core.locks import Lock
from core.tables import LineagePin


@dataclass(frozen=True)
class Pin:
    lineage: str
    version: int  # BASE_VERSION: held on the base model
    pinned_at: datetime
    note: str | None


class Pinned(Exception):
    """The lineage is pinned: held at its version by hand until it is unpinned."""

    def __init__(self, pin: Pin) -> None:
        super().__init__(
            f"lineage {pin.lineage} is pinned at {_label(pin.version)} since "
            f"{pin.pinned_at:%Y-%m-%d %H:%M:%S}"
            + (f" ({pin.note})" if pin.note else "")
            + "; unpin it, or pin another version"
        )
        self.pin = pin


def _label(version: int) -> str:
    return f"v{version}" if version else "the base model"


def _pin(row: LineagePin) -> Pin:
    return Pin(row.lineage, row.version, row.pinned_at, row.note)


def pin_of(lineage: str, *, session: Session) -> Pin | None:
    row = session.get(LineagePin, lineage)
    return _pin(row) if row else None


def by_lineage(*, session: Session) -> dict[str, Pin]:
    return {row.lineage: _pin(row) for row in session.scalars(select(LineagePin))}


def hold(lineage: str, version: int, note: str | None, *, session: Session) -> None:
    """Pin `lineage` at `version` (0: its base model), or move its pin there; the caller holds
    Lock.PUBLISH and makes the version current in the same transaction."""
    values = {"version": version, "note": note, "pinned_at": func.now()}
    session.execute(
        pg_insert(LineagePin)
        .values(lineage=lineage, **values)
        .on_conflict_do_update(index_elements=[LineagePin.lineage], set_=values)
    )


def unpin(lineage: str, *, session: Session) -> Pin | None:
    """Let the lineage move again (the trainer goes on from the pinned version); the pin it
    had, or None."""
    locks.hold(Lock.PUBLISH, session=session)
    held = pin_of(lineage, session=session)
    if held is not None:
        session.execute(delete(LineagePin).where(LineagePin.lineage == lineage))
    return held
