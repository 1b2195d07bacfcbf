"""Per-tenant quotas (FLYWHEEL_QUOTA_*, FLYWHEEL_TENANT_QUOTAS): what one tenant may take of a
proxy, so that another's calls do not queue behind it.

Four limits, each 0 for none, per tenant (core/tenants.py; the default tenant is `default`):
completion calls per second and in flight, reward posts per second, reads per second: which a
route counts against is its row's `quota` (proxy/route_table.py). A rate is a token
bucket holding `burst_s` seconds of it (at least one request). The edge asks `admit` before
anything else is done with a request: over a limit it is a 429 (OpenAI's shape, Anthropic's at
`/v1/messages`) with `Retry-After` (whole seconds until the bucket holds a request again), and
nothing is forwarded or recorded. An admitted completion call holds its slot until `release`,
which the edge calls once the response has ended, however it ended (the stream finished, the
client left, vLLM failed).

The quota holds across replicas: each proxy beats a heartbeat into Postgres (`proxy_replica`,
every FLYWHEEL_QUOTA_HEARTBEAT_S) and counts the replicas alive, and grants each tenant its share:
each rate divided by that count, the calls in flight too (at least one). The cost is one small
transaction per heartbeat, none per request. With Postgres unreachable a replica keeps the last
count it read; a replica that stops leaves at once, one that crashes is counted until its
heartbeat is three intervals old. (Shares are even: a load balancer that favours one replica
gives a tenant less than its quota, never more.)
The dashboard's reads as the operator (`OPERATOR`: the admin key, or anyone with auth off) are no
tenant's and not limited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from starlette.types import Scope

from core.database import OUTAGE_ERRORS, AsyncSessions
from proxy import metrics
from proxy.auth import principal_of
from proxy.config import ProxySettings, Quota
from proxy.errors import ApiError
from proxy.record.store import replicas

log = logging.getLogger(__name__)

_SLOT = "flywheel.quota_slot"  # in the scope of an admitted completion call: its tenant's state


class Bucket:
    """`rate` requests a second, `capacity` at once after idling."""

    __slots__ = ("at", "capacity", "rate", "tokens")

    def __init__(self, rate: float, burst_s: float) -> None:
        self.rate, self.capacity = rate, max(1.0, rate * burst_s)
        self.tokens, self.at = self.capacity, time.monotonic()

    def resize(self, rate: float, burst_s: float) -> None:
        """Another share of the tenant's rate: what it holds now is kept, up to the new size."""
        self.wait_s()  # filled at the old rate until now
        self.rate, self.capacity = rate, max(1.0, rate * burst_s)
        self.tokens = min(self.tokens, self.capacity)

    def wait_s(self) -> float:
        """0 if a request may go now (then call `take`), else the seconds until one may."""
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    def take(self) -> None:
        self.tokens -= 1


@dataclass
class _Tenant:
    name: str
    quota: Quota
    buckets: dict[str, Bucket] = field(default_factory=dict)  # kind -> bucket (limited kinds)
    in_flight: int = 0
    concurrency: int = 0  # this replica's share of quota.concurrency (0: no limit)

    def share(self, replicas: int) -> None:
        """This replica's share of each limit, `replicas` being alive."""
        quota = self.quota
        rates = {"calls": quota.rps, "rewards": quota.rewards_rps, "reads": quota.reads_rps}
        for kind, rate in rates.items():
            if not rate:
                continue
            if kind in self.buckets:
                self.buckets[kind].resize(rate / replicas, self.quota.burst_s)
            else:
                self.buckets[kind] = Bucket(rate / replicas, self.quota.burst_s)
        concurrency = self.quota.concurrency
        self.concurrency = max(1, concurrency // replicas) if concurrency else 0


class Quotas:
    def __init__(self, settings: ProxySettings) -> None:
        self._default = settings.quota
        # A tenant's own limits over the default's: only those it names.
        self._quotas = {
            tenant: self._default.model_copy(update=own.model_dump(include=own.model_fields_set))
            for tenant, own in settings.tenant_quotas.items()
        }
        self._tenants: dict[str | None, _Tenant] = {}
        self.replicas = 1  # alive, this one included (QuotaShare's heartbeat keeps it current)

    def share(self, replicas: int) -> None:
        """`replicas` proxies alive: each tenant's limits here are that share of its quota."""
        if replicas != self.replicas:
            log.info("%d proxies alive: each grants 1/%d of every quota", replicas, replicas)
        metrics.quota_replicas.set(replicas)  # (1 too: the gauge starts at 0)
        self.replicas = replicas
        for tenant in self._tenants.values():
            tenant.share(replicas)

    @staticmethod
    def wanted(settings: ProxySettings) -> bool:
        """Whether any limit is set (none: the edge skips quotas altogether)."""
        q = settings.quota
        limits = (q.rps, q.rewards_rps, q.reads_rps, q.concurrency)
        return any(limits) or bool(settings.tenant_quotas)

    def admit(self, scope: Scope, kind: str) -> None:
        """Raise a 429 if the request is over its tenant's quota of `kind` (its route's row's,
        proxy/route_table.py); else count it (a completion call takes a slot in flight, kept in
        the scope for `release`)."""
        principal = principal_of(scope)
        if principal.every_tenant:
            return
        tenant = self._tenants.get(principal.tenant) or self._tenant(principal.tenant)
        if kind == "calls" and tenant.concurrency and tenant.in_flight >= tenant.concurrency:
            raise _refusal(tenant, "concurrency", 1.0, self.replicas)
        bucket = tenant.buckets.get(kind)
        if bucket is not None:
            wait_s = bucket.wait_s()
            if wait_s:
                raise _refusal(tenant, kind, wait_s, self.replicas)
            bucket.take()
        if kind == "calls":
            tenant.in_flight += 1
            scope[_SLOT] = tenant

    def release(self, scope: Scope) -> None:
        """The end of a completion call `admit` let in (nothing for any other request)."""
        tenant = scope.pop(_SLOT, None)
        if tenant is not None:
            tenant.in_flight -= 1

    def _tenant(self, tenant: str | None) -> _Tenant:
        name = tenant or "default"
        state = _Tenant(name, self._quotas.get(name, self._default))
        state.share(self.replicas)
        self._tenants[tenant] = state
        return state


# kind -> (what it counts, its limit's name in Quota)
_LIMITS = {
    "calls": ("completion calls per second", "rps"),
    "concurrency": ("completion calls in flight", "concurrency"),
    "rewards": ("reward posts per second (demonstration posts too)", "rewards_rps"),
    "reads": ("reads per second", "reads_rps"),
}


def _refusal(tenant: _Tenant, kind: str, wait_s: float, replicas: int) -> ApiError:
    what, limit = _LIMITS[kind]
    retry_after = max(1, math.ceil(wait_s))
    metrics.quota_refusals.labels(tenant.name, limit).inc()
    shared = f", shared by {replicas} proxies" if replicas > 1 else ""
    return ApiError(
        429,
        f"tenant {tenant.name!r} is at its quota of {getattr(tenant.quota, limit):g} {what}"
        f"{shared} (FLYWHEEL_QUOTA_{limit.upper()}, or `{limit}` in FLYWHEEL_TENANT_QUOTAS); "
        f"retry after {retry_after} s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after)},
    )


class QuotaShare:
    """The heartbeat that keeps `Quotas.replicas` current: every `heartbeat_s`, this replica's
    row in `proxy_replica` is touched and the replicas alive (a heartbeat within three
    intervals) counted. Postgres unreachable: the last count stands."""

    def __init__(self, quotas: Quotas, sessions: AsyncSessions, heartbeat_s: float) -> None:
        self.quotas, self.sessions, self.heartbeat_s = quotas, sessions, heartbeat_s
        self.replica = f"proxy-{uuid.uuid4().hex[:12]}"
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.beat()  # shared from the first request when Postgres answers
        self._task = asyncio.create_task(self._run(), name="quota-heartbeat")

    async def beat(self) -> None:
        try:
            async with asyncio.timeout(self.heartbeat_s), self.sessions.begin() as session:
                alive = await replicas.beat(
                    self.replica, session=session, alive_s=3 * self.heartbeat_s
                )
        except (*OUTAGE_ERRORS, TimeoutError) as e:
            log.debug("quota heartbeat missed (%s): %d replicas assumed", e, self.quotas.replicas)
            return
        self.quotas.share(alive)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.beat()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(*OUTAGE_ERRORS, TimeoutError):
            async with asyncio.timeout(self.heartbeat_s), self.sessions.begin() as session:
                await replicas.leave(self.replica, session=session)
