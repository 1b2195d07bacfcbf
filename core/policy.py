"""The policy's adapter versions, from publish to retirement: one lifecycle for every process.

A *lineage* is one line of versions with its own current version: `policy` by default, or one per
agent role (`writer`, `rewriter`: proxy/config/relay.py's `adapter_per_agent` says which agent's
calls each serves; a trainer trains one, its `lineage` setting). Lineages belong to tenants:
a tenant's are named `<tenant>.<role>` (`acme.policy`, `acme.writer`), trained only on its calls and
served only to it; the names without a tenant are the default tenant's, and the shared ones for
tenants the proxy's FLYWHEEL_SHARED_LINEAGES lets in (core/naming.py). Version numbers come from one
sequence for all lineages, so `N` names one adapter everywhere (`<lineage>-vN`).

    publish  (trainer)  save policy-vN/ -> load_everywhere -> one transaction: the batch trained,
                        N inserted and made current, NOTIFY. With a canary rule, N is inserted
                        as a candidate instead: it serves a fraction of the lineage's episodes
                        (a hold: none) until `decide_canary` promotes it or retires it
                        (core/canary.py)
    activate (rollback) load_everywhere -> make_current; POST /admin/adapters/N/activate on the
                        proxy and `flywheel adapters activate N` both call `rollout.activate`
    pin                 activate, and hold the lineage there: publish raises Pinned (the trainer
                        waits, its queue kept), make_current too unless it moves the pin;
                        `unpin` lets the trainer go on from the pinned version
    import   (by hand)  an adapter trained elsewhere copied in as policy-vN/ -> load_everywhere
                        -> `add_current`: N inserted and made current in one transaction;
                        `flywheel adapters import DIR` calls `rollout.import_adapter`. The
                        lineage's trainer takes its weights over at its next publish (PolicyMoved)
    retire   (trainer)  core/retirement.py `mark_retired` (under the lock) -> unload_everywhere
                        -> delete the directory

Whoever moves `is_current` or retires a version holds Lock.PUBLISH (core/locks.py) for that
transaction; a move NOTIFYs POLICY_CHANNEL, which every proxy's alias follows at once.
Because retiring marks the row before anything is unloaded, and `make_current` refuses a retired
row under the same lock, a rollback racing a retirement either wins (the version is current, so
it is not retired) or gets `RetiredVersion`; never an alias on an unloaded adapter.

This is its SQL; the loads into every replica and `activate` are core/rollout.py. The SQL
functions take a sync `session` (the trainer's); the proxy and the CLI run them on their async
sessions with `core.database.run_sync`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.orm import Session

from core import canary, locks, pins
from core.locks import Lock
from core.naming import DEFAULT_LINEAGE, adapter_name
from core.tables import AdapterVersion

BASE_VERSION = 0  # the policy before any training: the base model itself
MAX_VERSION = 2**31 - 1  # versions are int4 columns (adapter_version, transition.policy_version)
POLICY_CHANNEL = "flywheel_policy"  # NOTIFY'd (delivered on commit) when `is_current` moves


@dataclass(frozen=True)
class Adapter:
    version: int
    lineage: str
    name: str
    path: str
    base_model: str
    is_current: bool
    created_at: datetime
    trained_transitions: int
    stats: dict[str, Any] | None  # the training step's figures
    retired_at: datetime | None


class UnknownVersion(LookupError):
    pass


class RetiredVersion(Exception):
    """The version was retired: unloaded everywhere, its directory deleted."""

    def __init__(self, name: str, retired_at: datetime) -> None:
        super().__init__(f"{name} was retired at {retired_at:%Y-%m-%d %H:%M:%S}")


class PolicyMoved(Exception):
    """Another version became current since the step began (a rollback, or another trainer's
    publish): publishing would fork the lineage. `current` is the version now (None: base)."""

    def __init__(self, parent: int | None, current: int | None, lineage: str) -> None:
        super().__init__(
            f"lineage {lineage} moved from {_label(parent)} to {_label(current)} during the step"
        )
        self.current = current


class CanaryOpen(Exception):
    """The lineage has a candidate under test already: one canary at a time per lineage."""


def _label(version: int | None) -> str:
    return "the base model" if version is None else f"v{version}"


def _adapter(row: AdapterVersion) -> Adapter:
    return Adapter(**{f.name: getattr(row, f.name) for f in fields(Adapter)})  # by name


def current(*, session: Session, lineage: str = DEFAULT_LINEAGE) -> Adapter | None:
    row = session.scalar(
        select(AdapterVersion).where(AdapterVersion.is_current, AdapterVersion.lineage == lineage)
    )
    return _adapter(row) if row else None


def currents(*, session: Session) -> dict[str, Adapter]:
    """Every lineage's current version (a lineage on its base model has none)."""
    rows = session.scalars(select(AdapterVersion).where(AdapterVersion.is_current))
    return {row.lineage: _adapter(row) for row in rows}


def get(version: int, *, session: Session) -> Adapter | None:
    row = session.get(AdapterVersion, version)
    return _adapter(row) if row else None


def named(name: str, *, session: Session) -> Adapter | None:
    row = session.scalar(select(AdapterVersion).where(AdapterVersion.name == name))
    return _adapter(row) if row else None


def versions(*, session: Session, lineage: str | None = None) -> list[Adapter]:
    """Oldest first; of one lineage, or of all (None)."""
    query = select(AdapterVersion).order_by(AdapterVersion.version)
    if lineage is not None:
        query = query.where(AdapterVersion.lineage == lineage)
    return [_adapter(row) for row in session.scalars(query)]


def next_version(*, session: Session) -> int:
    """A new version number; numbers come from a sequence, so two trainers never share one."""
    return int(session.execute(text("SELECT nextval('adapter_version_seq')")).scalar_one())


def _lock(session: Session) -> None:
    # Without it two publishers both clear the flag, then collide on setting it.
    locks.hold(Lock.PUBLISH, session=session)


def publish(
    *,
    session: Session,
    lineage: str,
    parent: int | None,
    version: int,
    path: str,
    base_model: str,
    stats: dict[str, Any],
    trained_transitions: int,
    canary_rule: canary.Rule | None = None,
    rejected: bool = False,
) -> None:
    """Record a new version as its lineage's current one (named `<lineage>-v<version>`); every
    proxy's alias follows when this commits. With `canary_rule` it becomes the lineage's canary
    candidate instead, the current version staying as it is (a hold, `fraction` 0: served to no
    episode until the gate decides it). `rejected` (the
    trainer's promotion gate, trainer/gate.py): recorded retired, never served, the current
    version staying as it is.

    Compare-and-set: `parent` (the version the new one was trained from; None: the base model)
    must still be the lineage's current one, else PolicyMoved and nothing is written. Without it
    a rollback would not stick (the next step publishes a descendant of the version rolled back
    from) and two trainers would publish two alternating, diverging policies. A pinned lineage
    takes nothing: Pinned.
    """
    _lock(session)
    held = pins.pin_of(lineage, session=session)
    if held is not None:
        raise pins.Pinned(held)
    mine = (AdapterVersion.is_current, AdapterVersion.lineage == lineage)
    now = session.scalar(select(AdapterVersion.version).where(*mine))
    if now != parent:
        raise PolicyMoved(parent, now, lineage)
    candidate = not rejected and canary_rule is not None
    if candidate and canary.opened(session=session, lineage=lineage):
        raise CanaryOpen(f"lineage {lineage} has a canary open already")
    serves = not candidate and not rejected  # at once, in place of the current version
    if serves:
        session.execute(update(AdapterVersion).where(*mine).values(is_current=False))
    _insert(
        session,
        lineage=lineage,
        version=version,
        path=path,
        base_model=base_model,
        is_current=serves,
        trained_transitions=trained_transitions,
        stats=stats,
        retired=rejected,
    )
    if candidate:
        assert canary_rule is not None
        canary.open_canary(
            session=session,
            lineage=lineage,
            candidate=version,
            baseline=BASE_VERSION if now is None else now,
            rule=canary_rule,
        )
    session.execute(text(f"NOTIFY {POLICY_CHANNEL}"))


def decide_canary(
    decided: canary.Canary,
    decision: canary.Decision,
    *,
    session: Session,
    then: canary.Rule | None = None,
) -> bool:
    """Carry out a canary's decision: promote makes the candidate current (or, with `then`, a
    hold's candidate opens a canary on that rule instead), rollback retires it (the trainer then
    unloads and deletes it). False when the canary was closed meanwhile."""
    _lock(session)
    if not canary.close(
        decided, decision.action, decision.reason, decision.evidence, session=session
    ):
        return False
    if decision.action == "promote" and then is not None:
        canary.open_canary(
            session=session,
            lineage=decided.lineage,
            candidate=decided.candidate,
            baseline=decided.baseline,
            rule=then,
        )
    elif decision.action == "promote":
        _move(decided.candidate, decided.lineage, session=session)
    else:
        session.execute(
            update(AdapterVersion)
            .where(AdapterVersion.version == decided.candidate)
            .values(retired_at=func.now())
        )
    session.execute(text(f"NOTIFY {POLICY_CHANNEL}"))
    return True


def restat(version: int, stats: dict[str, Any], *, session: Session) -> None:
    """Merge `stats` into a version's (a held version's gate, decided again)."""
    row = session.get(AdapterVersion, version)
    if row is None:
        raise UnknownVersion(f"no adapter version {version}")
    row.stats = {**(row.stats or {}), **stats}


def make_current(
    version: int | None,
    *,
    session: Session,
    lineage: str = DEFAULT_LINEAGE,
    pin: bool = False,
    note: str | None = None,
) -> None:
    """Make an existing version its lineage's current one, or put `lineage` back on the base
    model (None). The other lineages do not move. A canary open on the lineage is closed as
    superseded: a hand on the policy overrides the test. `pin`: and hold the lineage there (a
    pinned lineage moves only so: else Pinned)."""
    _lock(session)
    if version is not None:
        row = session.get(AdapterVersion, version)
        if row is None:
            raise UnknownVersion(f"no adapter version {version}")
        if row.retired_at is not None:
            raise RetiredVersion(row.name, row.retired_at)
        lineage = row.lineage
    held = pins.pin_of(lineage, session=session)
    if held is not None and not pin:
        raise pins.Pinned(held)
    for open_ in canary.opened(session=session, lineage=lineage).values():
        canary.close(open_, "superseded", f"made {_label(version)} current", None, session=session)
    _move(version, lineage, session=session)
    if pin:
        pins.hold(lineage, version or BASE_VERSION, note, session=session)
    session.execute(text(f"NOTIFY {POLICY_CHANNEL}"))


def add_current(
    *,
    session: Session,
    lineage: str,
    version: int,
    path: str,
    base_model: str,
    stats: dict[str, Any],
) -> None:
    """Record a version that no trainer of this lineage made (an imported adapter) and make it
    current, as a rollback would: whatever the lineage served before is its parent no longer,
    a canary open is closed as superseded, a pin refuses it (Pinned)."""
    _insert(
        session,
        lineage=lineage,
        version=version,
        path=path,
        base_model=base_model,
        is_current=False,
        trained_transitions=0,
        stats=stats,
    )
    make_current(version, session=session)


def _insert(
    session: Session,
    *,
    lineage: str,
    version: int,
    path: str,
    base_model: str,
    is_current: bool,
    trained_transitions: int,
    stats: dict[str, Any],
    retired: bool = False,
) -> None:
    """A version's row, named `<lineage>-v<version>` (publish's and add_current's); `retired`:
    retired from the start (rejected by the trainer's gate)."""
    session.execute(
        insert(AdapterVersion).values(
            version=version,
            lineage=lineage,
            name=adapter_name(lineage, version),
            path=path,
            base_model=base_model,
            is_current=is_current,
            trained_transitions=trained_transitions,
            stats=stats,
            retired_at=func.now() if retired else None,
        )
    )


def _move(version: int | None, lineage: str, *, session: Session) -> None:
    session.execute(
        update(AdapterVersion)
        .where(AdapterVersion.is_current, AdapterVersion.lineage == lineage)
        .values(is_current=False)
    )
    if version is not None:
        session.execute(
            update(AdapterVersion).where(AdapterVersion.version == version).values(is_current=True)
        )
