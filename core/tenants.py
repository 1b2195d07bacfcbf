"""Tenants and their API keys: who may call what, and whose episodes are whose.

A key belongs to one tenant and has scopes: `infer` (completions, responses, models), `reward`
(POST /v1/rewards), `read` (GET /v1/episodes). Keys are stored as SHA-256 hashes (`api_key`);
the key itself is shown once, when `flywheel keys create` makes it. Its form is
`fw_<id>_<secret>`: the id finds the row, the secret's hash is compared in constant time.

Ownership by name: a tenant's episode and task ids are stored as `<tenant>/<id>`. A tag can never
contain `/` (proxy/config/relay.py TAG_PATTERN), so no client can name another tenant's episode: a
read or a step reward across tenants finds nothing (404), a final reward for another tenant's id
lands in the caller's own namespace. Keys from FLYWHEEL_API_KEYS, and calls without auth,
belong to the default tenant (None): ids stored as given, as before tenants existed.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from core.tables import ApiKey

SCOPES = ("infer", "reward", "read")
TENANT_PATTERN = r"[a-z0-9][a-z0-9_-]{0,31}"
_TENANT = re.compile(TENANT_PATTERN)
_KEY = re.compile(r"fw_([0-9a-f]{12})_[A-Za-z0-9_-]{20,100}")


class BadKeyRequest(ValueError):
    pass


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant (None: the default one) and what it may do."""

    tenant: str | None
    scopes: frozenset[str]
    # The operator (the dashboard with the admin key, or with auth off): every tenant's rows,
    # addressed and shown by their stored ids (`acme/e1`).
    every_tenant: bool = False

    def own(self, public_id: str) -> str:
        """The stored id of one of this tenant's episode or task ids."""
        return public_id if self.tenant is None else f"{self.tenant}/{public_id}"

    def public(self, stored_id: str) -> str:
        return stored_id if self.tenant is None else stored_id.removeprefix(f"{self.tenant}/")

    def owns_episode(self, stored_id: str) -> bool:
        """Whether this principal may see the episode (or task) stored as `stored_id`: the same
        rule as `owns_episode_sql`, for an id a caller named (the default tenant's have no `/`)."""
        if self.every_tenant:
            return True
        if self.tenant is None:
            return "/" not in stored_id
        return stored_id.startswith(f"{self.tenant}/")

    def owns_episode_sql(self, column: str) -> tuple[str, dict[str, str]]:
        """A WHERE condition on a stored episode id column: the rows this principal may see."""
        if self.every_tenant:
            return "TRUE", {}
        if self.tenant is None:
            return f"strpos({column}, '/') = 0", {}
        return f"starts_with({column}, :tenant_prefix)", {"tenant_prefix": f"{self.tenant}/"}


DEFAULT = Principal(None, frozenset(SCOPES))  # no auth, or a key from FLYWHEEL_API_KEYS
OPERATOR = Principal(None, frozenset(SCOPES), every_tenant=True)

# The tenant of a stored row, in SQL (`Principal.own` in reverse): "default" for the default one.
TENANT_OF_EPISODE = (
    "(CASE WHEN strpos(episode_id, '/') > 0 THEN split_part(episode_id, '/', 1) ELSE 'default' END)"
)


@dataclass(frozen=True)
class KeyRow:
    id: str
    tenant: str
    scopes: list[str]
    name: str | None
    created_at: datetime
    revoked_at: datetime | None
    key_hash: bytes


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_id(key: str) -> str | None:
    """The id part of a well-formed key (None for anything else)."""
    match = _KEY.fullmatch(key)
    return match.group(1) if match else None


# --- SQL (sync sessions: the CLI; the proxy runs `active_keys` with run_sync) ------------------


def create_key(
    *, session: Session, tenant: str, scopes: list[str], name: str | None = None
) -> tuple[str, str]:
    """A new key for `tenant`: (its id, the key). The key is not stored, only its hash."""
    if not _TENANT.fullmatch(tenant) or tenant == "default":
        raise BadKeyRequest(
            f"tenant {tenant!r}: 1-32 of a-z 0-9 _ -, starting with a letter or digit "
            "('default' is the tenant of FLYWHEEL_API_KEYS)"
        )
    unknown = sorted(set(scopes) - set(SCOPES))
    if not scopes or unknown:
        raise BadKeyRequest(f"scopes must be some of {', '.join(SCOPES)} (got {scopes})")
    kid = secrets.token_hex(6)
    key = f"fw_{kid}_{secrets.token_urlsafe(32)}"
    session.execute(
        insert(ApiKey).values(
            id=kid, tenant=tenant, scopes=sorted(set(scopes)), name=name, key_hash=key_hash(key)
        )
    )
    return kid, key


def revoke_key(kid: str, *, session: Session) -> bool:
    """False if there is no such key (or it was revoked already)."""
    done = session.execute(
        update(ApiKey)
        .where(ApiKey.id == kid, ApiKey.revoked_at.is_(None))
        .values(revoked_at=func.now())
        .returning(ApiKey.id)
    ).first()
    return done is not None


def keys(*, session: Session, active_only: bool = False) -> list[KeyRow]:
    query = select(ApiKey).order_by(ApiKey.tenant, ApiKey.created_at)
    if active_only:
        query = query.where(ApiKey.revoked_at.is_(None))
    return [
        KeyRow(k.id, k.tenant, list(k.scopes), k.name, k.created_at, k.revoked_at, k.key_hash)
        for k in session.scalars(query)
    ]
