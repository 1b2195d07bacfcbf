"""An adapter version into every vLLM replica, or out of every one: the fan-out of the adapter
lifecycle (core/policy.py holds its SQL).

The one failure policy of "load into every replica, then move the alias": `load_everywhere`
loads into each replica that answers, skips one that does not, and undoes its own loads when one
refuses; the caller moves the alias only once it returns. `activate` (a rollback, or a pin) is
that order end to end: POST /admin/adapters/N/activate on the proxy and `flywheel adapters
activate N` both call it; `import_adapter` is the same for an adapter trained elsewhere
(`flywheel adapters import DIR`); the trainer's publish and retirement use the other two
(trainer/vllm.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core import naming, pins, policy
from core.database import AsyncSessions, run_sync
from core.vllm import Unreachable, VLLMAdmin, VLLMError

log = logging.getLogger(__name__)


# What is copied of an imported adapter: the weights vLLM and the trainer read. An optimizer
# state saved beside them is not (the trainer's Adam starts fresh on imported weights).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class BadAdapter(ValueError):
    """The directory is not a PEFT LoRA adapter this project can serve and train."""


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
    lineage: str = naming.DEFAULT_LINEAGE,
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
            held = await run_sync(session, pins.pin_of, lineage=adapter.lineage)
        if held is not None:
            raise pins.Pinned(held)
    rollout = await load_everywhere(vllm, urls, adapter.name, adapter.path)
    async with sessions.begin() as session:
        await run_sync(session, policy.make_current, version=version, pin=pin, note=note)
    return adapter, rollout


def check_adapter(source: Path) -> dict[str, object]:
    """A PEFT LoRA adapter directory's config, or BadAdapter saying what is wrong with it."""
    missing = [name for name in ADAPTER_FILES if not (source / name).is_file()]
    if not source.is_dir() or missing:
        needs = ", ".join(missing or ADAPTER_FILES)
        raise BadAdapter(f"{source} is not a PEFT LoRA adapter directory: it needs {needs}")
    try:
        config = json.loads((source / "adapter_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadAdapter(f"{source}/adapter_config.json does not read as JSON: {e}") from e
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise BadAdapter(f"{source} is not a LoRA adapter (its peft_type is not LORA)")
    if not isinstance(config.get("r"), int) or not isinstance(config.get("target_modules"), list):
        raise BadAdapter(f"{source}/adapter_config.json lacks an integer r or target_modules")
    return config


async def import_adapter(
    source: Path,
    *,
    sessions: AsyncSessions,
    vllm: VLLMAdmin,
    urls: Sequence[str],
    adapters_dir: Path,
    lineage: str = naming.DEFAULT_LINEAGE,
) -> tuple[policy.Adapter, Rollout]:
    """An adapter trained elsewhere (a warm start, another team's fine-tune) as `lineage`'s next
    version: copied into `adapters_dir` as `<lineage>-vN`, loaded everywhere, then made current
    (the order of a publish). The lineage's trainer starts from it, or takes its weights over
    at its next publish. Raises BadAdapter, Pinned, AdapterRejected or NoReplica, and then
    nothing is left behind: no row, no directory, nothing loaded."""
    config = check_adapter(source)
    async with sessions() as session:  # refused before anything is copied (checked again below)
        held = await run_sync(session, pins.pin_of, lineage=lineage)
    if held is not None:
        raise pins.Pinned(held)
    async with sessions.begin() as session:
        version = await run_sync(session, policy.next_version)
    name = naming.adapter_name(lineage, version)
    final = (adapters_dir / name).resolve()
    partial = adapters_dir / f".{name}.tmp"
    partial.mkdir(parents=True)
    for file in ADAPTER_FILES:
        shutil.copyfile(source / file, partial / file)
    os.rename(partial, final)  # vLLM never sees a half-copied adapter
    try:
        rollout = await load_everywhere(vllm, urls, name, str(final))
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise
    try:
        async with sessions.begin() as session:
            await run_sync(
                session,
                policy.add_current,
                lineage=lineage,
                version=version,
                path=str(final),
                base_model=str(config.get("base_model_name_or_path") or ""),
                stats={"imported_from": str(source.resolve())},
            )
            adapter = await run_sync(session, policy.get, version=version)
    except pins.Pinned:  # pinned meanwhile: nothing committed, so nothing is left
        await asyncio.gather(
            *(vllm.unload(url, name) for url in rollout.loaded), return_exceptions=True
        )
        shutil.rmtree(final, ignore_errors=True)
        raise
    # Postgres failing above raises with the directory left: whether it committed is unknown
    # (committed: it serves; not: the trainer's reconcile unloads and deletes the orphan).
    assert adapter is not None
    return adapter, rollout
