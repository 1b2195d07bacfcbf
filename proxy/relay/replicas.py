"""Keeping vLLM replicas fit for traffic: probe each, eject the silent, bring back the healed.

Every `replica_probe_s` each replica is asked for its models. One that does not answer leaves the
rotation (calls that fail to reach it do the same at once, in forward.py). One that answers gets
every lineage's current adapter loaded if it lacks it (a restarted or newly added vLLM has none)
and only then joins, or stays in, the rotation: policy traffic never reaches a replica without
its policy. One lineage's adapter that a replica refuses keeps only that lineage's calls off
that replica (`Replica.missing`); a replica that can load none of them stays out.
"""

from __future__ import annotations

import asyncio
import logging

from core.vllm import VLLMError
from proxy.relay.alias import PolicyAlias
from proxy.relay.upstream import Replica, Upstream

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # vLLM's API server answers /v1/models at once, however busy its engine


class ReplicaKeeper:
    def __init__(self, upstream: Upstream, alias: PolicyAlias, *, probe_s: float) -> None:
        self._upstream = upstream
        self._alias = alias
        self._probe_s = probe_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.probe_all()  # before the first call: replicas that lack the policy stay out
        self._task = asyncio.create_task(self._run(), name="flywheel-replicas")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._probe_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self._upstream.replicas))

    async def probe(self, replica: Replica) -> None:
        try:
            loaded = await self._upstream.vllm.loaded(replica.base_url, timeout_s=PROBE_TIMEOUT_S)
        except VLLMError as e:
            self._upstream.failed(replica, repr(e))
            return
        currents = self._alias.served()  # every lineage's current adapter and canary
        missing = frozenset(
            [n for n in currents if n not in loaded and not await self._alias.restore(replica, n)]
        )
        if missing != replica.missing:
            log.warning(
                "replica %s: %s",
                replica.base_url,
                f"could not load {', '.join(sorted(missing))}: their calls go elsewhere"
                if missing
                else "has every current adapter again",
            )
            replica.missing = missing
        if missing and missing == frozenset(currents):
            self._upstream.failed(
                replica, f"could not load any current adapter ({sorted(missing)})"
            )
            return
        self._upstream.restored(replica)
