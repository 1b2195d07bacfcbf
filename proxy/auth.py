"""Who is calling: `KeyRing.authenticate` turns an `Authorization` header into a Principal.

Keys come from two places: FLYWHEEL_API_KEYS (the default tenant, every scope; compared in
constant time, as ever) and the `api_key` table (core/tenants.py: hashed, per tenant, scoped,
revocable), which every proxy re-reads every `keys_refresh_s`, so a created or revoked key takes
effect on every replica within that. If Postgres is unreachable the last keys read stay in force.
Which scope each route needs is its row's `access` (proxy/route_table.py; edge.py applies it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Mapping
from typing import Any

from core import tenants
from core.database import OUTAGE_ERRORS, AsyncSessions, run_sync
from core.tenants import DEFAULT, Principal
from proxy.errors import ApiError
from proxy.route_table import Access

log = logging.getLogger(__name__)


class KeyRing:
    def __init__(
        self, env_keys: list[str], sessionmaker: AsyncSessions, *, refresh_s: float
    ) -> None:
        self._env_keys = [k.encode() for k in env_keys]
        self._sessionmaker = sessionmaker
        self._refresh_s = refresh_s
        self._db_keys: dict[str, tuple[bytes, Principal]] = {}  # key id -> (hash, principal)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll(), name="flywheel-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def refresh(self) -> None:
        try:
            async with self._sessionmaker() as session:
                rows = await run_sync(session, tenants.keys, active_only=True)
        except OUTAGE_ERRORS as e:  # keep the keys we have
            log.warning("could not re-read API keys (%s); the last ones read stay in force", e)
            return
        self._db_keys = {r.id: (r.key_hash, Principal(r.tenant, frozenset(r.scopes))) for r in rows}

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()

    def authenticate(self, header: bytes) -> Principal:
        scheme, _, key = header.partition(b" ")
        if scheme.lower() == b"bearer" and key:
            if any(hmac.compare_digest(key, k) for k in self._env_keys):
                return DEFAULT
            text = key.decode("ascii", "replace")
            kid = tenants.key_id(text)
            found = self._db_keys.get(kid) if kid else None
            if found is not None and hmac.compare_digest(tenants.key_hash(text), found[0]):
                return found[1]
        raise ApiError(
            401,
            "Missing or invalid API key: send `Authorization: Bearer <key>`, a key from "
            "FLYWHEEL_API_KEYS or one made with `flywheel keys create`.",
            code="invalid_api_key",
        )


def require(principal: Principal, access: Access, path: str) -> None:
    """403 unless the principal's key has the scope the access names (`infer`, `reward` or
    `read`; any other access is not an API key's to give)."""
    if access not in principal.scopes:
        raise ApiError(
            403,
            f"this API key lacks the {access!r} scope that {path} needs "
            f"(it has: {', '.join(sorted(principal.scopes)) or 'none'})",
            type="permission_error",
            code="insufficient_scope",
        )


def principal_of(scope: Mapping[str, Any]) -> Principal:
    """The caller the edge authenticated (the default tenant when auth is off)."""
    principal = scope.get("flywheel.principal", DEFAULT)
    assert isinstance(principal, Principal)
    return principal
