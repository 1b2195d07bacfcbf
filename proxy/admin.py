"""Rollback and roll-forward: point the policy alias at any version that is loaded or re-loadable.

Used by `POST /admin/adapters/{version}/activate` (FLYWHEEL_ADMIN_KEY) and by
`flywheel adapters activate N`. The adapter is loaded into every vLLM replica first; only then
does the alias move, so no request is sent to a model a replica does not have. A replica that
cannot be reached is ejected; it rejoins only once it has the current adapter (proxy/replicas.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from sqlalchemy.ext.asyncio import async_sessionmaker

from proxy import store
from proxy.alias import BASE_VERSION
from proxy.errors import ApiError
from proxy.upstream import AdapterError, Upstream


async def activate(
    version: int,
    *,
    sessionmaker: async_sessionmaker,  # type: ignore[type-arg]
    upstream: Upstream,
) -> dict[str, Any]:
    if version == BASE_VERSION:
        async with sessionmaker.begin() as session:
            await store.set_current(None, session=session)
        return {"version": 0, "name": None, "is_current": True}
    async with sessionmaker() as session:
        found = next(
            (a for a in await store.list_adapters(session=session) if a["version"] == version),
            None,
        )
    if found is None:
        raise ApiError(404, f"no adapter version {version}", code="adapter_not_found")
    loaded_into = 0
    for replica in upstream.replicas:
        try:
            if found["name"] not in await upstream.loaded_adapters(replica):
                if not Path(found["path"]).exists():
                    raise ApiError(
                        409,
                        f"{found['name']} is neither loaded in {replica.base_url} nor on disk "
                        f"at {found['path']} (retired); it cannot be activated",
                        code="adapter_not_loadable",
                    )
                await upstream.load_adapter(replica, found["name"], found["path"])
        except AdapterError as e:
            raise ApiError(
                502,
                f"vLLM refused {found['name']}: {e}; the alias did not move",
                type="upstream_error",
                code="adapter_rejected",
            ) from e
        except (aiohttp.ClientError, TimeoutError) as e:
            # Unreachable: out of rotation until a probe finds it and loads the current adapter.
            upstream.failed(replica, repr(e))
            continue
        loaded_into += 1
    if not loaded_into:
        raise ApiError(
            502, "no vLLM replica could be reached; the alias did not move", type="upstream_error"
        )
    async with sessionmaker.begin() as session:
        await store.set_current(version, session=session)
    return found | {"is_current": True}
