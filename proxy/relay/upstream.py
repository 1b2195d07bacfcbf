"""All outbound HTTP of the proxy: calls to vLLM, spread over its replicas.

Completion calls go through `proxy/relay/http1.py` (a keep-alive pool per replica, cheap per call);
the rare ones (models, adapters, probes) through core's `VLLMAdmin` (`Upstream.vllm`).

`pick()` chooses a replica per call: the episode's own replica (rendezvous hashing, so its growing
prompt hits that replica's prefix cache) unless that replica already carries more than
`LOAD_FACTOR` times the average load, in which case the next replica in the episode's order takes
it ("consistent hashing with bounded loads"); calls without an episode of their own go to the
replica with the fewest outstanding requests. A Responses call chained by `previous_response_id`
goes to the replica that answered its predecessor, whatever the load: vLLM keeps responses in
that replica's memory only (`homes`, the last `RESPONSE_HOMES` ids; a proxy restart forgets them,
and the chained call then gets vLLM's 404). A replica that fails to answer is ejected and
`proxy/relay/replicas.py` probes it until it answers again, with the current adapter loaded.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass

from core.vllm import MODELS_TIMEOUT_S, VLLMAdmin
from proxy import metrics
from proxy.relay import http1
from proxy.relay.token_texts import TokenTexts

log = logging.getLogger(__name__)

LOAD_FACTOR = 1.25  # an episode's replica may carry up to 1.25x the average before it spills
RESPONSE_HOMES = 100_000  # response ids remembered with their replica (~15 MB)


@dataclass(eq=False)
class Replica:
    base_url: str  # without /v1
    outstanding: int = 0  # calls sent and not yet finished (streams until their last byte)
    picked: int = 0  # calls ever sent: breaks ties between equally loaded replicas in turn
    in_rotation: bool = True
    failures: int = 0  # consecutive failed calls or probes
    # Current adapters it could not load (a lineage's): calls for them go elsewhere; the rest of
    # its traffic, other lineages' included, is not held up by one lineage's adapter.
    missing: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        metrics.replica_up.labels(self.base_url).set(1)
        metrics.replica_outstanding.labels(self.base_url).set_function(lambda: self.outstanding)


class Upstream:
    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None,
        timeout_s: float,
        dead_after_s: float = http1.DEAD_AFTER_S,
    ) -> None:
        if not urls:
            raise ValueError("no upstream: pass --upstream URL (or FLYWHEEL_UPSTREAM)")
        self.replicas = [Replica(url) for url in dict.fromkeys(urls)]
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._timeout_s = timeout_s
        # No connection limit: vLLM, not the proxy, decides how many requests it batches.
        self._pools = {
            r.base_url: http1.Pool(r.base_url, headers, dead_after_s=dead_after_s)
            for r in self.replicas
        }
        self.vllm = VLLMAdmin(api_key=api_key)  # models, adapters, probes
        self.token_texts = TokenTexts(self.vllm)  # the dashboard's tokens view
        self._homes: OrderedDict[str, Replica] = OrderedDict()  # response id -> its replica

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        await self.vllm.close()

    def replica(self, base_url: str) -> Replica:
        return next(r for r in self.replicas if r.base_url == base_url)

    # --- choosing a replica -----------------------------------------------------------------

    def pick(
        self,
        episode_id: str | None,
        exclude: tuple[Replica, ...] = (),
        *,
        previous_response: str | None = None,
        model: str | None = None,
    ) -> Replica | None:
        """The replica for the next call of this episode (None: every replica was excluded), one
        that has `model` if any has.

        The caller owns the returned replica's `outstanding` slot and must `release()` it.
        """
        candidates = [r for r in self.replicas if r.in_rotation and r not in exclude]
        if model is not None:
            candidates = [r for r in candidates if model not in r.missing] or candidates
        home = self._homes.get(previous_response) if previous_response else None
        if home is not None and home in candidates:
            candidates = [home]
        elif not candidates:
            # All out of rotation: try one anyway (it may be back) rather than fail untried.
            rest = [r for r in self.replicas if r not in exclude]
            if not rest:
                return None
            candidates = [min(rest, key=lambda r: r.failures)]
        if len(candidates) == 1:
            chosen = candidates[0]
        elif episode_id is None:
            chosen = min(candidates, key=lambda r: (r.outstanding, r.picked))
        else:
            chosen = self._bounded(episode_id, candidates)
        chosen.outstanding += 1
        chosen.picked += 1
        return chosen

    @staticmethod
    def _bounded(episode_id: str, candidates: list[Replica]) -> Replica:
        total = sum(r.outstanding for r in candidates) + 1
        bound = math.ceil(LOAD_FACTOR * total / len(candidates))
        key = episode_id.encode()
        ranked = sorted(
            candidates,
            key=lambda r: hashlib.blake2b(key + r.base_url.encode(), digest_size=8).digest(),
            reverse=True,
        )
        # The least loaded replica always fits under the bound; min() only guards that proof.
        fits = (r for r in ranked if r.outstanding + 1 <= bound)
        return next(fits, min(ranked, key=lambda r: r.outstanding))

    def release(self, replica: Replica) -> None:
        replica.outstanding -= 1

    def remember(self, response_id: str, base_url: str) -> None:
        """This replica answered (and stored) this response: chained calls go there."""
        if len(self.replicas) > 1:
            self._homes[response_id] = self.replica(base_url)
            if len(self._homes) > RESPONSE_HOMES:
                self._homes.popitem(last=False)

    # --- replica health ---------------------------------------------------------------------

    def failed(self, replica: Replica, reason: object) -> None:
        """A call or probe could not reach this replica: take it out until a probe succeeds."""
        replica.failures += 1
        if replica.in_rotation:
            replica.in_rotation = False
            metrics.replica_up.labels(replica.base_url).set(0)
            metrics.replica_ejections.labels(replica.base_url).inc()
            log.warning("replica %s ejected: %s", replica.base_url, reason)

    def restored(self, replica: Replica) -> None:
        replica.failures = 0
        if not replica.in_rotation:
            replica.in_rotation = True
            metrics.replica_up.labels(replica.base_url).set(1)
            log.warning("replica %s back in rotation", replica.base_url)

    # --- requests ---------------------------------------------------------------------------

    async def post(self, replica: Replica, path: str, body: bytes) -> http1.Response:
        """A completion call: returns once vLLM's status and headers are in; the caller reads the
        body and then `release()`s (or `close()`s) the response. Raises http1.UpstreamBroken
        (vLLM was not reached: safe to send elsewhere) or TimeoutError."""
        return await self._pools[replica.base_url].post(path, body, timeout_s=self._timeout_s)

    async def models(self, timeout_s: float = MODELS_TIMEOUT_S) -> tuple[int, bytes]:
        """GET /v1/models of the first replica in rotation (raises core.vllm.Unreachable)."""
        return await self.vllm.models(self.any_url(), timeout_s=timeout_s)

    def any_url(self) -> str:
        """The first replica in rotation (any one, if none is): for calls any of them answers."""
        live = [r for r in self.replicas if r.in_rotation]
        return (live[0] if live else self.replicas[0]).base_url
