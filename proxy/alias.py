"""The policy alias: `policy` -> the current adapter (or the base model), `policy@N` -> version N.

Whoever moves the current version (the trainer's publish, a rollback) NOTIFYs `flywheel_policy` in
the same transaction; a listening connection re-reads the version the moment that commits, so the
next call already uses the new adapter. A poll every `alias_refresh_s` is the fallback for while
the listening connection is down. No database round trip per request either way.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
import psycopg

from core import policy
from core.database import AsyncSessions, run_sync
from core.policy import BASE_VERSION
from core.vllm import VLLMError
from proxy.errors import ApiError
from proxy.upstream import Replica, Upstream

log = logging.getLogger(__name__)


class PolicyAlias:
    def __init__(
        self,
        alias: str,
        sessionmaker: AsyncSessions,
        upstream: Upstream,
        *,
        base_model: str | None,
        refresh_s: float,
        listen_url: str | None = None,
    ) -> None:
        self.alias = alias
        self._sessionmaker = sessionmaker
        self._upstream = upstream
        self.base_model = base_model
        self._refresh_s = refresh_s
        self.current: tuple[int, str] | None = None
        self._names: dict[int, str] = {}  # version -> adapter name; versions never change name
        self._versions: dict[str, int] = {}
        self._listen_url = listen_url
        self._tasks: list[asyncio.Task[None]] = []
        self._restoring = asyncio.Lock()

    async def start(self) -> None:
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._poll(), name="flywheel-alias-poll"))
        if self._listen_url:
            self._tasks.append(asyncio.create_task(self._listen(), name="flywheel-alias-listen"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def refresh(self) -> None:
        try:
            async with self._sessionmaker() as session:
                adapter = await run_sync(session, policy.current)
        except Exception as e:  # Postgres down: keep serving the version we know
            log.debug("alias refresh failed: %s", e)
            return
        current = (adapter.version, adapter.name) if adapter else None
        if current != self.current:
            log.info("policy alias now -> %s", current[1] if current else "base model")
            self.current = current
        if current:
            self._remember(*current)

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

    def _remember(self, version: int, name: str) -> None:
        self._names[version] = name
        self._versions[name] = version

    async def resolve(self, model: str) -> tuple[str, int | None]:
        """The model to send upstream, and the policy version it serves (None: not a policy)."""
        if model == self.alias:
            if self.current:
                return self.current[1], self.current[0]
            return await self._base(), BASE_VERSION
        if model.startswith(self.alias + "@"):
            return await self._pinned(model), int(model.partition("@")[2])
        if model in self._versions:
            return model, self._versions[model]
        if model == self.base_model:
            return model, BASE_VERSION
        return model, None

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

    async def _pinned(self, model: str) -> str:
        suffix = model.partition("@")[2]
        if not suffix.isdigit():
            raise ApiError(
                400,
                f"model {model!r}: the version after '@' must be a number, e.g. {self.alias}@3",
                param="model",
                code="invalid_model",
            )
        version = int(suffix)
        if version == BASE_VERSION:
            return await self._base()
        if version not in self._names:
            async with self._sessionmaker() as session:
                adapter = await run_sync(session, policy.get, version=version)
            if adapter is None:
                raise ApiError(
                    404,
                    f"The model `{model}` does not exist: no adapter version {version}.",
                    type="NotFoundError",
                    param="model",
                    code="model_not_found",
                )
            self._remember(version, adapter.name)
        return self._names[version]

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
