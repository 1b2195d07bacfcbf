"""`flywheel eval add|list|remove`: a lineage's eval sets (core/evals.py), which each new version
is asked before it serves (trainer/evals.py) and the promotion gate compares.

    flywheel eval add NAME --lineage L --from items.jsonl [--scorer exact|judge|python:mod:fn]
    flywheel eval add NAME --lineage L --from export.jsonl --min-return 1   # good answers only
    flywheel eval list [--lineage L]
    flywheel eval remove NAME --lineage L
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from core import database, evals
from core.settings import DatabaseSettings
from flywheel.options import add_settings, build


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["add", "list", "remove"])
    parser.add_argument("name", nargs="?", help="with add, remove: the set's name")
    parser.add_argument("--lineage", help="the lineage whose versions are asked it")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        help="with add: a JSONL file of items, or of rows from `flywheel export` (core/evals.py)",
    )
    parser.add_argument(
        "--scorer",
        default="exact",
        help="with add: `exact` (the answer is the reference), `judge` (an LLM judge grades "
        "it: the trainer's FLYWHEEL_EVAL_JUDGE_*) or `python:module:function`",
    )
    parser.add_argument(
        "--min-return",
        type=float,
        help="with add from an export: only the calls whose return is at least this",
    )
    parser.add_argument("--replace", action="store_true", help="with add: replace a set")
    add_settings(parser, DatabaseSettings)


def run(args: argparse.Namespace) -> None:
    """add, list or remove a lineage's eval sets"""
    settings = build(DatabaseSettings, args)
    try:
        with database.migrated_session(settings.database_url, settings.home) as session:
            if args.action == "add":
                items = _items(args)
                added = evals.add(
                    session=session,
                    lineage=args.lineage,
                    name=args.name,
                    scorer_spec=args.scorer,
                    items=items,
                    source=str(args.source),
                    replace=args.replace,
                )
                print(
                    f"eval set {added.name} of {added.lineage}: {len(items)} items, scorer "
                    f"{added.scorer}, digest {added.digest}"
                )
            elif args.action == "remove":
                if not args.name or not args.lineage:
                    sys.exit("flywheel eval remove NAME --lineage L")
                if not evals.remove(session=session, lineage=args.lineage, name=args.name):
                    sys.exit(f"flywheel eval: {args.lineage} has no eval set {args.name!r}")
                print(f"removed eval set {args.name} of {args.lineage}")
            else:
                for s in evals.sets(session=session, lineage=args.lineage):
                    print(
                        f"{s.lineage:<20} {s.name:<20} {len(s.items):>6} items  "
                        f"{s.scorer:<24} {s.digest}  {s.source}"
                    )
    except evals.BadEvalSet as e:
        sys.exit(f"flywheel eval: {e}")


def _items(args: argparse.Namespace) -> list[dict[str, object]]:
    if not args.name or not args.lineage or not args.source:
        sys.exit("flywheel eval add NAME --lineage L --from FILE.jsonl [--scorer S]")
    try:
        lines = args.source.read_bytes().splitlines()
    except OSError as e:
        sys.exit(f"flywheel eval: cannot read {args.source}: {e}")
    if args.min_return is not None:
        lines = [line for line in lines if line.strip() and _returned(line, args.min_return)]
    return evals.read_items(lines, args.source.name)


def _returned(line: bytes, least: float) -> bool:
    """An export row whose call earned at least `least` (a row without a return: no)."""
    try:
        got = orjson.loads(line).get("return")
    except (orjson.JSONDecodeError, AttributeError):
        return True  # read_items says what is wrong with it
    return isinstance(got, int | float) and got >= least
