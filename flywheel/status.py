"""`flywheel status`: one screen for an operator.

Each lineage's current version, pin and canary, its queue (credited, untrained), its
demonstrations never trained yet (of all it has), and last step (a GRPO or a supervised one);
the last steps with what the off-policy correction did; and of the last hour's and last day's
recorded calls, the share that became training data and, for the rest, why, with what to change
(core/trainable.py has the words).

    flywheel status [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text

from core import canary, database, pins, policy
from core.database import Sessions
from core.settings import DatabaseSettings
from core.tables import TRAINABLE
from core.trainable import REASONS, Share, explain, fates_sql, shares
from flywheel.options import add_settings, build

WINDOWS = (("last hour", "1 hour"), ("last day", "1 day"))


@dataclass
class LineageStatus:
    lineage: str
    current: int | None
    pinned: int | None
    pin_note: str | None
    canary: str | None  # "v44 at 10%"
    queue: int
    last_step: policy.Adapter | None
    demonstrations: tuple[int, int] = (0, 0)  # (never trained yet, all)


@dataclass
class Status:
    at: datetime
    lineages: list[LineageStatus] = field(default_factory=list)
    steps: list[policy.Adapter] = field(default_factory=list)
    windows: dict[str, tuple[Share, dict[str, Share]]] = field(default_factory=dict)


def collect(sessions: Sessions, *, steps: int = 5) -> Status:
    with sessions.begin() as session:
        now = session.execute(text("SELECT now()")).scalar_one()
        versions = policy.versions(session=session)
        held = pins.by_lineage(session=session)
        canaries = canary.opened(session=session)
        queued = session.execute(
            text(
                f"SELECT lineage, count(*) FROM transition WHERE {TRAINABLE} "
                "AND lineage IS NOT NULL GROUP BY 1"
            )
        ).all()
        queue: dict[str, int] = {lineage: int(n) for lineage, n in queued}
        demos = session.execute(
            text(
                "SELECT lineage, count(*) FILTER (WHERE epochs = 0 AND skip_reason IS NULL), "
                "count(*) FROM demonstration GROUP BY 1"
            )
        ).all()
        demonstrations = {lineage: (int(new), int(n)) for lineage, new, n in demos}
        windows = {}
        for label, interval in WINDOWS:
            rows = session.execute(
                text(fates_sql(f"t.requested_at >= now() - interval '{interval}'"))
            ).all()
            windows[label] = shares([(f, lin, n) for f, lin, n in rows])
    status = Status(at=now, windows=windows)
    names = sorted({a.lineage for a in versions} | set(held) | set(queue) | set(demonstrations))
    for name in names:
        mine = [a for a in versions if a.lineage == name]
        current = next((a.version for a in mine if a.is_current), None)
        test = canaries.get(name)
        pin = held.get(name)
        status.lineages.append(
            LineageStatus(
                lineage=name,
                current=current,
                pinned=pin.version if pin else None,
                pin_note=pin.note if pin else None,
                canary=(
                    f"v{test.candidate} held by the gate"
                    if test and test.rule.held
                    else f"v{test.candidate} at {test.rule.fraction:.0%}"
                    if test
                    else None
                ),
                queue=int(queue.get(name, 0)),
                last_step=max(mine, key=lambda a: a.version, default=None),
                demonstrations=demonstrations.get(name, (0, 0)),
            )
        )
    status.steps = sorted(versions, key=lambda a: -a.version)[:steps]
    return status


def render(s: Status) -> str:
    out = [f"Flywheel status at {s.at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC", ""]
    out.append(
        f"{'LINEAGE':<16}{'CURRENT':<10}{'PINNED':<10}{'CANARY':<14}{'QUEUE':>7}{'DEMOS':>12}"
        "  LAST STEP"
    )
    for lin in s.lineages:
        step = lin.last_step
        last = f"v{step.version} {_ago(s.at, step.created_at)}" if step else "none yet"
        new, total = lin.demonstrations
        demos = f"{new}/{total}" if total else "-"
        out.append(
            f"{lin.lineage:<16}{_v(lin.current):<10}{_v(lin.pinned):<10}{lin.canary or '-':<14}"
            f"{lin.queue:>7}{demos:>12}  {last}"
        )
    if not s.lineages:
        out.append("(no lineage has a version or a queue yet)")
    out += ["", "LAST STEPS"]
    for a in s.steps:
        out.append(f"  {_step(s.at, a)}")
    if not s.steps:
        out.append("  none yet")
    for label, (everything, by_lineage) in s.windows.items():
        out += ["", f"RECORDED CALLS, {label.upper()}: {everything.total}"]
        out += _share_lines(everything)
        if len(by_lineage) > 1:
            for name, share in sorted(by_lineage.items()):
                ratio = share.ratio
                out.append(
                    f"    lineage {name}: {share.trained} trained"
                    + (f" ({ratio:.0%} of decided)" if ratio is not None else "")
                )
    return "\n".join(out)


def _share_lines(share: Share) -> list[str]:
    if not share.total:
        return ["  no calls"]
    ratio = share.ratio
    lines = [
        f"  became training data: {share.trained}"
        + (f" ({ratio:.0%} of the {share.decided} decided)" if ratio is not None else ""),
        f"  waiting: {share.calls.get('awaiting_reward', 0)} for a reward, "
        f"{share.calls.get('queued', 0)} for a trainer",
    ]
    rest = share.not_trained()
    if rest:
        lines.append("  not training data:")
        lines += [f"    {explain(fate, n)}" for fate, n in rest]
    return lines


def _step(at: datetime, a: policy.Adapter) -> str:
    stats: dict[str, Any] = a.stats or {}
    tally = stats.get("by_staleness") or {}
    tokens = sum(t.get("tokens", 0) for t in tally.values())
    rejected = sum(t.get("rejected", 0) for t in tally.values())
    truncated = sum(t.get("truncated", 0) for t in tally.values())
    corrected = (
        f", tokens {tokens}: {truncated / tokens:.0%} truncated, {rejected / tokens:.0%} rejected"
        if tokens
        else ""
    )
    reward = stats.get("reward_mean")
    if stats.get("kind") == "sft":  # a supervised step on demonstrations
        loss = stats.get("loss")
        return (
            f"{a.name:<20}{_ago(at, a.created_at):<14}supervised: {stats.get('demonstrations')}"
            " demonstrations" + (f", loss {loss:.3f}" if loss is not None else "") + _ope(stats)
        )
    return (
        f"{a.name:<20}{_ago(at, a.created_at):<14}{stats.get('samples', a.trained_transitions)}"
        f" samples" + (f", reward {reward:.3f}" if reward is not None else "") + corrected
    ) + _ope(stats)


def _ope(stats: dict[str, Any]) -> str:
    """Its eval-set scores and off-policy estimate against its parent's (FLYWHEEL_EVALS,
    FLYWHEEL_OPE), if made, and the promotion gate's verdict (FLYWHEEL_GATE) when not a pass."""
    verdict = stats.get("gate") or {}
    if verdict and verdict.get("outcome") != "pass":
        return f"; gate {verdict['outcome']}: {verdict['reason']}"
    said = "".join(
        f"; eval {name} {e['score']:.3f} vs {e['current']:.3f}"
        for name, e in sorted((stats.get("evals") or {}).items())
    )
    ope = stats.get("ope")
    if not ope:
        return said
    if ope.get("refused"):
        return said + f"; estimate refused ({ope['episodes']} episodes: not enough overlap)"
    if not ope.get("candidate") or ope["candidate"]["value"] is None:
        return said + "; no logged episode to estimate on"
    d = ope["difference"]
    return said + (
        f"; estimated {ope['candidate']['value']:.3f} vs {ope['current']['value']:.3f} "
        f"({d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}], {ope['episodes']} episodes)"
    )


def _v(version: int | None) -> str:
    return "-" if version is None else f"v{version}"


def _ago(at: datetime, then: datetime) -> str:
    s = max(0.0, (at - then).total_seconds())
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.0f} h ago" if s < 172800 else f"{s / 86400:.0f} days ago"


def as_json(s: Status) -> dict[str, Any]:
    """The same, for scripts (`flywheel status --json`)."""
    return {
        "at": s.at.isoformat(),
        "lineages": [
            {
                "lineage": lin.lineage,
                "current": lin.current,
                "pinned": lin.pinned,
                "canary": lin.canary,
                "queue": lin.queue,
                "demonstrations": {
                    "never_trained": lin.demonstrations[0],
                    "all": lin.demonstrations[1],
                },
            }
            for lin in s.lineages
        ],
        "windows": {
            label: {
                "calls": everything.calls,
                "trainable_ratio": everything.ratio,
                "reasons": {f: explain(f, n) for f, n in everything.not_trained()},
                "lineages": {k: v.calls for k, v in by_lineage.items()},
            }
            for label, (everything, by_lineage) in s.windows.items()
        },
        "known_reasons": sorted(REASONS),
    }


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=5, help="how many of the last steps to show")
    parser.add_argument("--json", action="store_true", help="the same figures as JSON")
    add_settings(parser, DatabaseSettings)


def run(args: argparse.Namespace) -> None:
    """one screen: lineages, queue, last steps, and what became of the recorded calls"""
    settings = build(DatabaseSettings, args)
    engine, sessions = database.create_sessions(
        database.resolve_url(settings.database_url, settings.home)
    )
    try:
        status = collect(sessions, steps=args.steps)
    finally:
        engine.dispose()
    print(json.dumps(as_json(status), indent=2) if args.json else render(status))
