"""An adapter version into every vLLM replica, or out of every one: the fan-out of the adapter
lifecycle (core/policy.py holds its SQL).

The one failure policy of "load into every replica, then move the alias": `load_everywhere`
loads into each replica that answers, skips one that does not, and undoes its own loads when one
refuses; the caller moves the alias only once it returns. `activate` (a rollback, or a pin) is
that order end to end: POST /admin/adapters/N/activate on the proxy and `flywheel adapters
activate N` both call it; the trainer's publish and retirement use the other two
(trainer/vllm.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from core import policy
from core.database import AsyncSessions, run_sync
from core.vllm import Unreachable, VLLMAdmin, VLLMError

log = logging.getLogger(__name__)


class NoReplica(VLLMError):
    """No vLLM replica could be reached: nothing was loaded, the alias did not move."""


@dataclass(frozen=True)
class Rollout:
    """Where a version went: `loaded` has it now; `unreachable` did not answer."""

    loaded: list[str]
    unreachable: list[str]
    seconds: float


async def load_everywhere(vllm: VLLMAdmin, urls: Sequence[str], name: str, path: str) -> Rollout:
    """Load `name` into every replica that answers, or into none. The one failure policy of
    "load into every replica, then move the alias"; its caller moves the alias only on return.

    - A replica that has it already counts as loaded.
    - A replica that does not answer is skipped: it takes no policy traffic until it has the
      current adapter (the proxy's probe and the trainer's reconcile load it there).
    - A replica that refuses it (a bad adapter, a rank above its --max-lora-rank, a missing
      directory): it is unloaded from the replicas this call loaded it into, and AdapterRejected
      is raised. No replica reached: NoReplica. Either way the alias must not move.
    """
    started = time.perf_counter()
    outcomes = await asyncio.gather(
        *(_load(vllm, url, name, path) for url in urls), return_exceptions=True
    )
    took = [url for url, outcome in zip(urls, outcomes, strict=True) if outcome is True]
    had = [url for url, outcome in zip(urls, outcomes, strict=True) if outcome is False]
    unreachable = [url for url, o in zip(urls, outcomes, strict=True) if isinstance(o, Unreachable)]
    failed = [
        o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, Unreachable)
    ]
    if failed or not (took or had):
        # Undo (a replica that fails this too keeps an unused adapter until a reconcile).
        await asyncio.gather(*(vllm.unload(url, name) for url in took), return_exceptions=True)
        if failed:
            raise failed[0]
        raise NoReplica(f"no vLLM replica reachable to load {name}: {', '.join(unreachable)}")
    return Rollout(took + had, unreachable, time.perf_counter() - started)


async def _load(vllm: VLLMAdmin, url: str, name: str, path: str) -> bool:
    """True: loaded now; False: it was there already, from this path.

    The same name from another path is a stale adapter of another life of the database (reset,
    or restored from a backup, while vLLM kept running): vLLM would serve its weights under this
    version's name, so it is unloaded and ours loaded."""
    there = await vllm.adapters(url)
    if name in there:
        if there[name] is None or os.path.normpath(str(there[name])) == os.path.normpath(path):
            return False
        log.warning("%s serves %s from %s, not %s: replacing it", url, name, there[name], path)
        await vllm.unload(url, name)
    await vllm.load(url, name, path)
    return True


async def unload_everywhere(vllm: VLLMAdmin, urls: Sequence[str], name: str) -> None:
    """Unload `name` from every replica; raises unless every one confirmed (then its directory
    must stay: vLLM reads adapters lazily, and a missing directory can crash its engine)."""
    outcomes = await asyncio.gather(
        *(vllm.unload(url, name) for url in urls), return_exceptions=True
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


async def activate(
    version: int,
    *,
    sessions: AsyncSessions,
    vllm: VLLMAdmin,
    urls: Sequence[str],
    lineage: str = policy.DEFAULT_LINEAGE,
    pin: bool = False,
    note: str | None = None,
) -> tuple[policy.Adapter | None, Rollout | None]:
    """Roll back (or forward) to `version`, in its own lineage (0: `lineage` back on the base
    model): load it everywhere, then move that lineage's alias; `pin`: and hold it there.
    Raises UnknownVersion, RetiredVersion, Pinned, AdapterRejected or NoReplica, and then the
    alias has not moved. The database is not held while vLLM loads."""
    if version == policy.BASE_VERSION:
        async with sessions.begin() as session:
            await run_sync(
                session, policy.make_current, version=None, lineage=lineage, pin=pin, note=note
            )
        return None, None
    async with sessions() as session:
        adapter = await run_sync(session, policy.get, version=version)
    if adapter is None:
        raise policy.UnknownVersion(f"no adapter version {version}")
    if adapter.retired_at is not None:
        raise policy.RetiredVersion(adapter.name, adapter.retired_at)
    if not pin:  # refused before anything is loaded (make_current checks again, under the lock)
        async with sessions() as session:
            held = await run_sync(session, policy.pin_of, lineage=adapter.lineage)
        if held is not None:
            raise policy.Pinned(held)
    rollout = await load_everywhere(vllm, urls, adapter.name, adapter.path)
    async with sessions.begin() as session:
        await run_sync(session, policy.make_current, version=version, pin=pin, note=note)
    return adapter, rollout
