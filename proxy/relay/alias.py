"""The policy alias: `policy` -> the current adapter of the calling agent's lineage (or the base
model), `policy@N` -> version N.

Each lineage has its own current version (core/policy.py). Agents named in `adapter_per_agent`
are served by their lineage; every other call (no agent tag, or another agent) by the default
lineage `policy` — with per-agent lineages and no trainer on `policy`, that is the base model.

Lineages belong to tenants (core/policy.py): a tenant's `policy` is its own lineage
(`acme.policy`), unless `shares` says it opted into the shared ones. A version of a lineage the
caller may not see, named by `policy@N` or by its adapter name, is a 404 exactly like a version
that does not exist.

A lineage with an open canary (core/canary.py) serves its candidate to a fraction of episodes,
chosen by a hash of the episode id: every call of an episode, on every replica, gets the same one.

Whoever moves the current version or opens or closes a canary (the trainer, a rollback) NOTIFYs
`flywheel_policy` in the same transaction; a listening connection re-reads the versions the moment
that commits, so the next call already uses the new adapter. A poll every `alias_refresh_s` is the
fallback for while the listening connection is down. No database round trip per request either way,
except the first call to a pinned version this proxy has not seen (`policy@N`: one row, then cached;
a 503 while Postgres is down).

Each lineage's current version is also kept in a file (`snapshot`, under FLYWHEEL_HOME): a proxy
that starts while Postgres is unreachable serves the versions it last knew, not the base model,
until Postgres answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import psycopg

from core import canary, naming, policy
from core.database import OUTAGE_ERRORS, AsyncSessions, run_sync
from core.policy import BASE_VERSION
from core.vllm import VLLMError
from proxy.errors import ApiError
from proxy.relay.upstream import Replica, Upstream

log = logging.getLogger(__name__)

MAX_VERSION = 2**31 - 1  # adapter_version.version is an integer column: no version beyond it
# Looking up one adapter row by key takes milliseconds; longer, Postgres is unreachable (dropped
# packets hang a connect) and the client is better told so than kept waiting.
LOOKUP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Resolved:
    model: str  # what vLLM is asked for
    version: int | None  # the policy version serving it (0: the base model); None: not a policy
    lineage: str | None  # the lineage that version belongs to (for a trainer to claim)


class PolicyAlias:
    def __init__(
        self,
        alias: str,
        sessionmaker: AsyncSessions,
        upstream: Upstream,
        *,
        base_model: str | None,
        refresh_s: float,
        lineages: dict[str, str] | None = None,
        shares: Callable[[str | None], bool] = lambda tenant: tenant is None,
        listen_url: str | None = None,
        snapshot: Path | None = None,
    ) -> None:
        self.alias = alias
        self._lineage_of_agent = lineages or {}
        self._shares = shares
        self._sessionmaker = sessionmaker
        self._upstream = upstream
        self.base_model = base_model
        self._refresh_s = refresh_s
        self.current: dict[str, tuple[int, str]] = {}  # lineage -> its current (version, name)
        self.canaries: dict[str, canary.Canary] = {}  # lineage -> its open canary
        # Versions never change name or lineage: version -> (name, lineage), and name -> version.
        self._names: dict[int, tuple[str, str]] = {}
        self._versions: dict[str, int] = {}
        self._absent: set[int] = set()  # versions looked up and not found since the last refresh
        self._listen_url = listen_url
        self._tasks: list[asyncio.Task[None]] = []
        self._restoring = asyncio.Lock()
        self._snapshot = snapshot

    async def start(self) -> None:
        if not await self.refresh():
            self._load_snapshot()
        self._tasks.append(asyncio.create_task(self._poll(), name="flywheel-alias-poll"))
        if self._listen_url:
            self._tasks.append(asyncio.create_task(self._listen(), name="flywheel-alias-listen"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def refresh(self) -> bool:
        """Re-read the versions; False: Postgres did not answer (the ones we know stay)."""
        try:
            async with self._sessionmaker() as session:
                adapters = await run_sync(session, policy.currents)
                canaries = await run_sync(session, canary.opened)
        except Exception as e:  # Postgres down: keep serving the versions we know
            log.debug("alias refresh failed: %s", e)
            return False
        for lineage in sorted(canaries.keys() | self.canaries.keys()):
            now_open, was_open = canaries.get(lineage), self.canaries.get(lineage)
            if (now_open and now_open.id) != (was_open and was_open.id):
                log.info(
                    "lineage %s canary: %s",
                    lineage,
                    now_open.serving() if now_open else "closed",
                )
        self.canaries = canaries
        self._absent.clear()
        for c in canaries.values():
            self._remember(c.candidate, c.candidate_name, c.lineage)
        current = {lineage: (a.version, a.name) for lineage, a in adapters.items()}
        for lineage in sorted(current.keys() | self.current.keys()):
            if current.get(lineage) != self.current.get(lineage):
                now = current.get(lineage)
                log.info("lineage %s now -> %s", lineage, now[1] if now else "base model")
        if current != self.current:
            self._save_snapshot(current)
        self.current = current
        for lineage, (version, name) in current.items():
            self._remember(version, name, lineage)
        return True

    def _save_snapshot(self, current: dict[str, tuple[int, str]]) -> None:
        if self._snapshot is None:
            return
        try:  # written whole, then renamed over: a reader sees the old file or the new one
            tmp = self._snapshot.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(orjson.dumps(current))
            os.replace(tmp, self._snapshot)
        except OSError as e:
            log.warning("could not keep the policy alias in %s: %s", self._snapshot, e)

    def _load_snapshot(self) -> None:
        if self._snapshot is None or not self._snapshot.exists():
            log.warning("Postgres unreachable at start-up: serving the base model until it answers")
            return
        try:
            saved = orjson.loads(self._snapshot.read_bytes())
            current = {lineage: (int(v), str(n)) for lineage, (v, n) in saved.items()}
        except (OSError, ValueError, TypeError) as e:
            log.warning("unreadable policy alias snapshot %s: %s", self._snapshot, e)
            return
        self.current = current
        for lineage, (version, name) in current.items():
            self._remember(version, name, lineage)
        log.warning(
            "Postgres unreachable at start-up: serving the versions last known (%s) until it "
            "answers",
            ", ".join(f"{lineage} -> {name}" for lineage, (_, name) in sorted(current.items())),
        )

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()

    async def _listen(self) -> None:
        assert self._listen_url is not None
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._listen_url, autocommit=True
                ) as conn:
                    await conn.execute(f"LISTEN {policy.POLICY_CHANNEL}")
                    await self.refresh()  # anything published while nobody was listening
                    async for _ in conn.notifies():
                        await self.refresh()
            except (psycopg.Error, OSError) as e:
                log.debug("policy listener down (the poll covers it): %s", e)
            await asyncio.sleep(self._refresh_s)

    def _remember(self, version: int, name: str, lineage: str) -> None:
        self._names[version] = (name, lineage)
        self._versions[name] = version

    def lineage_of(self, agent: str | None, tenant: str | None = None) -> str:
        role = self._lineage_of_agent.get(agent or "", naming.DEFAULT_LINEAGE)
        return naming.lineage_for(tenant, role, shared=self._shares(tenant))

    def served(self) -> list[str]:
        """Every adapter `policy` may resolve to now: each lineage's current one and canary."""
        names = [name for _, name in self.current.values()]
        return names + [c.candidate_name for c in self.canaries.values()]

    def sees(self, tenant: str | None, lineage: str) -> bool:
        return naming.sees(tenant, lineage, shared=self._shares(tenant))

    async def resolve(
        self,
        model: str,
        agent: str | None = None,
        episode_id: str | None = None,
        tenant: str | None = None,
    ) -> Resolved:
        """What to send upstream for `model` called by `agent` of `tenant` in `episode_id`, and
        which policy serves it."""
        lineage = self.lineage_of(agent, tenant)
        if model == self.alias:
            test = self.canaries.get(lineage)
            if test and episode_id and canary.in_canary(episode_id, test.candidate, test.fraction):
                return Resolved(test.candidate_name, test.candidate, lineage)
            if lineage in self.current:
                version, name = self.current[lineage]
                return Resolved(name, version, lineage)
            return Resolved(await self._base(), BASE_VERSION, lineage)
        if model.startswith(self.alias + "@"):
            name, pinned_lineage = await self._pinned(model, tenant)
            version = int(model.partition("@")[2])
            return Resolved(name, version, lineage if version == BASE_VERSION else pinned_lineage)
        if model == self.base_model:
            return Resolved(model, BASE_VERSION, lineage)
        named = naming.ADAPTER_NAME.fullmatch(model)
        if named is not None:  # an adapter by its own name (`<lineage>-vN`): check whose
            version = int(named.group(2))
            if version not in self._names and version not in self._absent:
                adapter = await self._lookup(model, version) if version <= MAX_VERSION else None
                if adapter is None:
                    self._absent.add(version)  # until the next refresh (a publish NOTIFYs)
                else:
                    self._remember(version, adapter.name, adapter.lineage)
            known = self._names.get(version)
            if known is None or known[0] != model or not self.sees(tenant, known[1]):
                raise _not_found(model)  # no such adapter, or another tenant's: alike
            return Resolved(model, version, known[1])
        return Resolved(model, None, None)

    async def restore(self, replica: Replica, name: str) -> bool:
        """vLLM answered 404 for an adapter we serve: it restarted. Load it again (once)."""
        if name not in self._versions:
            return False
        async with self._restoring:  # a burst of 404s loads it once
            try:
                if name in await self._upstream.vllm.loaded(replica.base_url):
                    return True
                async with self._sessionmaker() as session:
                    adapter = await run_sync(session, policy.named, name=name)
                if adapter is None or adapter.retired_at is not None:
                    return False
                await self._upstream.vllm.load(replica.base_url, name, adapter.path)
            except VLLMError as e:
                log.warning("could not reload %s into %s: %s", name, replica.base_url, e)
                return False
        log.warning("reloaded %s into %s (vLLM had lost it)", name, replica.base_url)
        return True

    async def _pinned(self, model: str, tenant: str | None) -> tuple[str, str]:
        """`policy@N`: the adapter's name and lineage (the base model's name for N = 0)."""
        suffix = model.partition("@")[2]
        if not (suffix.isascii() and suffix.isdigit()):  # ('²' and '٣' pass isdigit())
            raise ApiError(
                400,
                f"model {model!r}: the version after '@' must be a number, e.g. {self.alias}@3",
                param="model",
                code="invalid_model",
            )
        version = int(suffix)
        if version == BASE_VERSION:
            return await self._base(), naming.DEFAULT_LINEAGE
        if version not in self._names:
            adapter = await self._lookup(model, version) if version <= MAX_VERSION else None
            if adapter is None:
                raise _not_found(model)
            self._remember(version, adapter.name, adapter.lineage)
        name, lineage = self._names[version]
        if not self.sees(tenant, lineage):  # another tenant's: as if there were no such version
            raise _not_found(model)
        return name, lineage

    async def _lookup(self, model: str, version: int) -> policy.Adapter | None:
        """A version this proxy has not served yet (every current and canary one is cached):
        one row by its key. Postgres down: a 503 that says so, not an error of our own."""
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S), self._sessionmaker() as session:
                return await run_sync(session, policy.get, version=version)
        except OUTAGE_ERRORS as e:
            raise ApiError(
                503,
                f"model {model!r}: version {version} is not known to this proxy yet and the "
                f"database is unavailable ({type(e).__name__}) to look it up; retry later, or "
                f"call `{self.alias}`",
                type="service_unavailable",
                param="model",
                code="database_unavailable",
            ) from e

    async def _base(self) -> str:
        if self.base_model is None:
            # The first model vLLM lists without a parent is the one it was started with.
            try:
                status, body = await self._upstream.models()
            except VLLMError as e:
                raise ApiError(
                    502, f"vLLM did not list its models: {e}", type="upstream_error"
                ) from e
            if status != 200:
                raise ApiError(502, "vLLM did not list its models", type="upstream_error")
            models = orjson.loads(body)["data"]
            self.base_model = next(m["id"] for m in models if not m.get("parent"))
        return self.base_model


def _not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        type="NotFoundError",
        param="model",
        code="model_not_found",
    )
