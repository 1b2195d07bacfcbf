"""What is recorded, from the command line: `flywheel migrate` (the schema), `flywheel export`
(rows to JSON Lines or Parquet, core/export.py) and `flywheel retain` (old days dropped or
archived, core/retention.py).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from core import database, retention
from core.export import FORMATS, KINDS, ExportFilter, export
from core.settings import DatabaseSettings
from core.tenants import OPERATOR, Principal
from flywheel.options import add_settings, build


def migrate_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, DatabaseSettings)


def migrate(args: argparse.Namespace) -> None:
    """apply the database migrations and exit"""
    settings = build(DatabaseSettings, args)
    database.migrate(database.resolve_url(settings.database_url, settings.home))
    print("database is at the newest migration")


def export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="the file: .parquet for Parquet, else JSON Lines")
    parser.add_argument("--kind", choices=KINDS, default="transitions")
    parser.add_argument("--format", choices=FORMATS, help="default: from OUT's suffix")
    parser.add_argument("--tokens", action="store_true", help="token ids and logprobs too")
    parser.add_argument("--tenant", help="only this tenant's rows, under its own ids")
    parser.add_argument("--since", type=datetime.fromisoformat, help="requested at or after")
    parser.add_argument("--until", type=datetime.fromisoformat, help="requested before")
    parser.add_argument("--agent")
    parser.add_argument("--task", help="a task id (the tenant's own with --tenant)")
    parser.add_argument("--version", type=int, help="the policy version that served it")
    parser.add_argument("--lineage")
    parser.add_argument("--min-reward", type=float, help="the episode's final reward at least")
    parser.add_argument("--max-reward", type=float, help="the episode's final reward at most")
    parser.add_argument("--trained", choices=["yes", "no"], help="trained on already, or not yet")
    add_settings(parser, DatabaseSettings)


def export_rows(args: argparse.Namespace) -> None:
    """recorded transitions to JSON Lines or Parquet (core/export.py)"""
    settings = build(DatabaseSettings, args)
    tenant = args.tenant
    where = ExportFilter(
        principal=OPERATOR
        if tenant is None
        else Principal(None if tenant == "default" else tenant, frozenset()),
        since=args.since,
        until=args.until,
        agent=args.agent,
        task=args.task,
        version=args.version,
        lineage=args.lineage,
        min_reward=args.min_reward,
        max_reward=args.max_reward,
        trained=None if args.trained is None else args.trained == "yes",
    )
    url = database.resolve_url(settings.database_url, settings.home)
    try:
        done = export(
            url, args.out, kind=args.kind, fmt=args.format, where=where, tokens=args.tokens
        )
    except (OSError, RuntimeError, ValueError, SQLAlchemyError) as e:
        sys.exit(f"flywheel export: {e}")
    rate = done.rows / done.seconds if done.seconds else 0.0
    print(f"{done.rows} {args.kind} rows to {done.path} in {done.seconds:.1f} s ({rate:,.0f}/s)")


def retain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--days", type=int, required=True, help="whole UTC days kept, besides today"
    )
    parser.add_argument("--archive", type=Path, help="export each day to DIR/<day>.parquet first")
    parser.add_argument(
        "--include-untrained", action="store_true", help="drop days a trainer has not used yet"
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")
    add_settings(parser, DatabaseSettings)


def retain(args: argparse.Namespace) -> None:
    """drop (or archive, then drop) recorded days older than N (core/retention.py)"""
    settings = build(DatabaseSettings, args)
    url = database.resolve_url(settings.database_url, settings.home)
    engine, _ = database.create_sessions(url)

    def say(d: retention.Decision) -> None:
        what = {"drop": "archived and dropped" if d.archive else "dropped"}.get(d.action, d.action)
        if args.dry_run and d.action == "drop":
            what = "would drop"
        reason = f": {d.reason}" if d.reason else ""
        print(f"{d.partition.name}: {d.rows} transitions, {_mib(d.bytes)} -> {what}{reason}")

    try:
        done = retention.retain(
            engine,
            url,
            days=args.days,
            archive=args.archive,
            include_untrained=args.include_untrained,
            dry_run=args.dry_run,
            on_decision=say,
        )
    except (OSError, ValueError, SQLAlchemyError) as e:
        sys.exit(f"flywheel retain: {e}")
    finally:
        engine.dispose()
    print(f"cutoff {done.cutoff:%Y-%m-%d %H:%M} UTC; {len(done.decisions)} days older")
    if not args.dry_run:
        print(
            f"deleted {done.episodes} episodes, {done.rewards} of their rewards, "
            f"{done.messages} messages, {done.blocks} token id blocks"
        )
    for table, before in done.bytes_before.items():
        print(f"  {table}: {_mib(before)} -> {_mib(done.bytes_after[table])}")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
