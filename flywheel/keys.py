"""`flywheel keys create|list|revoke`: tenants' API keys (core/tenants.py). A key is printed once,
on stdout alone (for scripts); only its SHA-256 is stored.
"""

from __future__ import annotations

import argparse
import sys

from sqlalchemy.orm import Session

from core import database, tenants
from core.settings import DatabaseSettings
from flywheel.options import add_settings, build


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["create", "list", "revoke"])
    parser.add_argument("id", nargs="?", help="with revoke: the key's id (from `keys list`)")
    parser.add_argument("--tenant", help="with create: whose key (its episodes are its own)")
    parser.add_argument(
        "--scopes", default="infer,reward,read", help="with create: comma-separated"
    )
    parser.add_argument("--name", help="with create: a note (who or what uses it)")
    add_settings(parser, DatabaseSettings)


def run(args: argparse.Namespace) -> None:
    """create, list or revoke tenants' API keys"""
    settings = build(DatabaseSettings, args)
    try:
        with database.migrated_session(settings.database_url, settings.home) as session:
            if args.action == "create":
                _create(args, session)
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


def _create(args: argparse.Namespace, session: Session) -> None:
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
