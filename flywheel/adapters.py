"""`flywheel adapters list|canaries|activate|pin|unpin|import`: the adapter versions of every
lineage, their canaries, moving a lineage's alias by hand (rollback, pin) and bringing in an
adapter trained elsewhere, through `core/policy.py` and `core/rollout.py`, the same code path as
the trainer's publish and the proxy's admin routes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core import canary, database, naming, pins, policy, rollout
from core.settings import DatabaseSettings, vllm_base_urls
from core.vllm import VLLMAdmin, VLLMError
from flywheel.options import add_settings, build


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=list(ACTIONS))
    parser.add_argument("version", nargs="?", type=int, help="with activate, pin: the version")
    parser.add_argument("--vllm", action="append", help="vLLM base URL(s) to load it into")
    parser.add_argument(
        "--lineage",
        help="list, canaries: only this lineage; activate/pin 0: the lineage put back on the "
        "base; unpin: this lineage (default policy)",
    )
    parser.add_argument("--note", help="with pin: why, shown with the pin")
    parser.add_argument(
        "--adapter",
        type=Path,
        help="with import: a PEFT LoRA adapter directory (adapter_config.json and "
        "adapter_model.safetensors) trained elsewhere on the served base model",
    )
    parser.add_argument(
        "--adapters-dir",
        type=Path,
        default=os.environ.get("FLYWHEEL_ADAPTERS_DIR"),
        help="with import: the trainer's adapters directory (its FLYWHEEL_ADAPTERS_DIR), which "
        "vLLM reads too; the adapter is copied in as <lineage>-vN",
    )
    add_settings(parser, DatabaseSettings)


def run(args: argparse.Namespace) -> None:
    """list adapter versions, or switch the alias"""
    settings = build(DatabaseSettings, args)
    ACTIONS[args.action](args, database.resolve_url(settings.database_url, settings.home))


def _list(args: argparse.Namespace, url: str) -> None:
    engine, sessions = database.create_sessions(url)
    with sessions() as session:
        adapters = policy.versions(session=session, lineage=args.lineage)
        tests = canary.opened(session=session, lineage=args.lineage)
        held = pins.by_lineage(session=session)
    engine.dispose()
    by_lineage: dict[str, list[policy.Adapter]] = {}
    for a in adapters:
        by_lineage.setdefault(a.lineage, []).append(a)
    for lineage, versions in sorted(by_lineage.items()):
        current = next((a.name for a in versions if a.is_current), "the base model")
        test = tests.get(lineage)
        under_test = f"; canary {test.serving()} for {test.age_s:.0f}s" if test else ""
        pin = held.get(lineage)
        pinned = (
            f"; pinned since {pin.pinned_at:%Y-%m-%d %H:%M}"
            + (f" ({pin.note})" if pin.note else "")
            if pin
            else ""
        )
        print(f"lineage {lineage}: {len(versions)} versions, serving {current}{under_test}{pinned}")
        for a in versions:
            mark = "*" if a.is_current else "c" if test and test.candidate == a.version else " "
            reward = (a.stats or {}).get("reward_mean", float("nan"))
            state = f"retired {a.retired_at:%Y-%m-%d %H:%M}" if a.retired_at else a.path
            print(
                f"  {mark} v{a.version:<5} {a.name:<16} {a.created_at:%Y-%m-%d %H:%M:%S} "
                f"trained={a.trained_transitions:<6} reward={reward:.3f} {state}"
            )


def _canaries(args: argparse.Namespace, url: str) -> None:
    engine, sessions = database.create_sessions(url)
    with sessions() as session:
        rows = canary.history(session=session, lineage=args.lineage)
    engine.dispose()
    for row in rows:
        print(_canary_line(row))
    if not rows:
        print("no canaries yet (the trainer opens them with FLYWHEEL_CANARY_FRACTION > 0)")


def _canary_line(row: Any) -> str:
    """One canary: when, which versions, what was decided and on what evidence."""
    head = f"{row.opened_at:%Y-%m-%d %H:%M:%S} {row.lineage}: v{row.candidate} vs v{row.baseline}"
    if row.decided_at is None and row.fraction == 0:
        return f"{head}: held by the gate, served to no one, open"
    if row.decided_at is None:
        return f"{head} on {row.fraction:.0%} of episodes, open"
    took = (row.decided_at - row.opened_at).total_seconds()
    line = f"{head}: {row.action} ({row.reason}) after {took:.0f}s"
    e = row.evidence
    if e and e["candidate_mean"] is not None and e["baseline_mean"] is not None:
        line += (
            f" | reward {e['candidate_mean']:.3f} on {e['candidate_episodes']} episodes vs "
            f"{e['baseline_mean']:.3f} on {e['baseline_episodes']}"
        )
        if e["p_worse"] is not None:
            line += f" | p(worse) {e['p_worse']:.3g} p(not worse) {e['p_not_worse']:.3g}"
    return line


def _unpin(args: argparse.Namespace, url: str) -> None:
    lineage = args.lineage or naming.DEFAULT_LINEAGE
    engine, sessions = database.create_sessions(url)
    with sessions.begin() as session:
        was = pins.unpin(lineage, session=session)
    engine.dispose()
    print(f"lineage {lineage} unpinned" if was else f"lineage {lineage} was not pinned")


def _activate(args: argparse.Namespace, url: str) -> None:
    """activate and pin: load the version into every vLLM, then move its lineage's alias."""
    if args.version is None or not args.vllm:
        sys.exit(f"flywheel adapters {args.action} N --vllm URL [--vllm URL ...]")
    try:
        urls = vllm_base_urls(args.vllm, "--vllm")
        lineage = naming.check_lineage(args.lineage or naming.DEFAULT_LINEAGE)
    except ValueError as e:
        sys.exit(f"flywheel adapters: {e}")

    async def activate() -> policy.Adapter | None:
        engine, sessions = database.create_async_sessions(url, pool_size=1)
        vllm = VLLMAdmin(api_key=None)
        try:
            adapter, went = await rollout.activate(
                args.version,
                sessions=sessions,
                vllm=vllm,
                urls=urls,
                lineage=lineage,
                pin=args.action == "pin",
                note=args.note,
            )
        finally:
            await vllm.close()
            await engine.dispose()
        for unreachable in went.unreachable if went else ():
            print(f"warning: {unreachable} unreachable; it does not have the adapter yet")
        return adapter

    try:
        adapter = asyncio.run(activate())
    except (policy.UnknownVersion, policy.RetiredVersion, pins.Pinned, VLLMError) as e:
        sys.exit(f"flywheel adapters: {e}")
    pinned = ", pinned" if args.action == "pin" else ""
    if adapter is None:
        print(f"lineage {lineage} now serves the base model{pinned}")
    else:
        print(f"lineage {adapter.lineage} now serves {adapter.name}{pinned}")


def _import(args: argparse.Namespace, url: str) -> None:
    """import: copy the adapter in as the lineage's next version, load it, make it current."""
    if args.adapter is None or args.adapters_dir is None or not args.vllm:
        sys.exit(
            "flywheel adapters import --adapter DIR --adapters-dir DIR --vllm URL [--vllm URL ...]"
            " [--lineage L]"
        )
    try:
        urls = vllm_base_urls(args.vllm, "--vllm")
        lineage = naming.check_lineage(args.lineage or naming.DEFAULT_LINEAGE)
        rollout.check_adapter(args.adapter)
    except ValueError as e:
        sys.exit(f"flywheel adapters: {e}")

    async def bring_in() -> tuple[policy.Adapter, rollout.Rollout]:
        engine, sessions = database.create_async_sessions(url, pool_size=1)
        vllm = VLLMAdmin(api_key=None)
        try:
            return await rollout.import_adapter(
                args.adapter,
                sessions=sessions,
                vllm=vllm,
                urls=urls,
                adapters_dir=args.adapters_dir,
                lineage=lineage,
            )
        finally:
            await vllm.close()
            await engine.dispose()

    try:
        adapter, went = asyncio.run(bring_in())
    except (pins.Pinned, VLLMError, OSError) as e:
        sys.exit(f"flywheel adapters: {e}")
    for unreachable in went.unreachable:
        print(f"warning: {unreachable} unreachable; it does not have the adapter yet")
    print(f"lineage {adapter.lineage} now serves {adapter.name} (imported from {args.adapter})")


ACTIONS: dict[str, Callable[[argparse.Namespace, str], None]] = {
    "list": _list,
    "activate": _activate,
    "pin": _activate,
    "unpin": _unpin,
    "canaries": _canaries,
    "import": _import,
}
