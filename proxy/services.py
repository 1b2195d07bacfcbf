"""Everything a route may use, started once by the app's lifespan and handed to each route as one
typed object: `ServicesDep` for FastAPI routes, `services_of(app)` for the edge's fast lane.

Start-up: import litellm if there are provider models (proxy/relay/providers.py), find the
database (configured or embedded), migrate it (or, if Postgres does not answer, start on the
journal and migrate once it does: proxy/record/migrator.py), start the background writer
(replaying any journal left from before), the upstream client, the alias, the replica probes
and the housekeeping of partitions and retention (proxy/record/maintenance.py).
Shutdown, in reverse, within FLYWHEEL_SHUTDOWN_FLUSH_S (after uvicorn's drain of the calls in
flight): housekeeping stops (a round in progress is left behind), probes stop, records still being
scored (proxy/relay/scoring.py) are handed to the writer (half the flush time at most), the alias
stops, then every recorded transition is flushed (to Postgres, or to the journal if Postgres can't
take them in what is left), then connections close.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, cast

from fastapi import Depends, FastAPI, Request

from core import database
from core.codecs import PromptMemo
from core.database import AsyncSessions
from proxy.auth import KeyRing
from proxy.config import ProxySettings
from proxy.quotas import Quotas, QuotaShare
from proxy.record.air import ToolCheck
from proxy.record.intake import Intake
from proxy.record.journal import Journal
from proxy.record.maintenance import Maintenance
from proxy.record.migrator import Migrator
from proxy.record.recorder import Recorder
from proxy.record.replay import ReplayChunks
from proxy.record.tracing import Spans
from proxy.relay.alias import PolicyAlias
from proxy.relay.forward import Forwarder
from proxy.relay.forward_provider import ProviderForwarder
from proxy.relay.handoff import Handoff
from proxy.relay.providers import Providers
from proxy.relay.replicas import ReplicaKeeper
from proxy.relay.scoring import Scorer
from proxy.relay.upstream import Upstream

# Of the shutdown's flush time, what scoring in flight may take (one short call to vLLM each);
# the writer has the rest, and at least this much.
SCORING_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)  # built once, by name
class Services:
    settings: ProxySettings
    sessionmaker: AsyncSessions  # readers: each statement bounded by FLYWHEEL_READ_TIMEOUT_S
    writer_sessions: AsyncSessions  # the writer's own pool (FLYWHEEL_WRITER_POOL_SIZE)
    reward_sessions: AsyncSessions  # reward and demonstration posts (FLYWHEEL_REWARD_POOL_SIZE)
    recorder: Recorder
    upstream: Upstream
    alias: PolicyAlias
    forwarder: Forwarder
    keys: KeyRing
    migrator: Migrator
    quotas: Quotas | None  # per-tenant limits, when any is set (the edge admits by them)
    spans: Spans | None = None  # FLYWHEEL_OTEL_ENDPOINT
    # GET /v1/export: each running export holds a reader connection (proxy/routes/export.py).
    export_slots: ExportSlots


class ExportSlots:
    """GET /v1/export's running streams: at most `most` on this proxy, `per_tenant` of them one
    tenant's (FLYWHEEL_EXPORTS_MAX, FLYWHEEL_EXPORTS_PER_TENANT)."""

    def __init__(self, most: int, per_tenant: int) -> None:
        self.most, self.per_tenant = most, per_tenant
        self.running: Counter[str] = Counter()  # tenant -> its exports running

    def take(self, tenant: str) -> str | None:
        """A slot for `tenant` (None), or why there is none (the 429's message)."""
        if self.running.total() >= self.most:
            return f"{self.most} exports are running on this proxy; retry when one is done"
        if self.running[tenant] >= self.per_tenant:
            return (
                f"this tenant runs {self.per_tenant} export(s) on this proxy already, the most "
                "one tenant may (FLYWHEEL_EXPORTS_PER_TENANT); retry when one is done"
            )
        self.running[tenant] += 1
        return None

    def give_back(self, tenant: str) -> None:
        self.running[tenant] -= 1
        if self.running[tenant] <= 0:
            del self.running[tenant]


@asynccontextmanager
async def running(settings: ProxySettings) -> AsyncIterator[Services]:
    providers = None
    if settings.routes:  # litellm (a second or two to import) first: nothing to undo if absent
        providers = await asyncio.to_thread(
            Providers,
            settings.routes,
            timeout_s=settings.route_timeout_s,
            retries=settings.route_retries,
        )
    url = await asyncio.to_thread(database.resolve_url, settings.database_url, settings.home)
    # Three pools: readers (the API, dashboard, export, admin; each statement bounded by
    # read_timeout_s), the writer's own (recording, replays; never bounded by it), and the posts'
    # (rewards, demonstrations), so neither readers holding every connection of theirs nor
    # reward posts queued on one episode's row lock can make recording wait or spill.
    engine, sessionmaker = database.create_async_sessions(
        url, statement_timeout_s=settings.read_timeout_s
    )
    # A write transaction's backend orphaned by a partition is ended (core/database.py).
    orphans_s = database.WRITE_IDLE_IN_TRANSACTION_S
    writer_engine, writer_sessions = database.create_async_sessions(
        url, pool_size=settings.writer_pool_size, idle_in_transaction_s=orphans_s
    )
    reward_engine, reward_sessions = database.create_async_sessions(
        url, pool_size=settings.reward_pool_size, idle_in_transaction_s=orphans_s
    )
    migrator = Migrator(url, sessionmaker, writer_sessions, retry_s=settings.journal_retry_s)
    await migrator.start()  # Postgres unreachable: serve on the journal, migrate when it answers
    api_key = settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
    upstream = Upstream(
        settings.upstream,
        api_key=api_key,
        timeout_s=settings.upstream_timeout_s,
        dead_after_s=settings.upstream_dead_after_s,
    )
    spans = (
        Spans(settings.otel_endpoint, settings.otel_service_name)
        if settings.otel_endpoint
        else None
    )
    journal = Journal(settings.journal_dir)
    with journal.guard("redrive"):  # rows refused before a fix or a migration: once more
        journal.redrive_rejected()
    recorder = Recorder(
        writer_sessions,
        journal,
        batch_size=settings.writer_batch_size,
        linger_s=settings.writer_linger_s,
        queue_max_bytes=settings.writer_queue_max_bytes,
        retry_s=settings.journal_retry_s,
        gamma=settings.credit_gamma,
        air_penalty=settings.air_penalty,
        spans=spans,
        memo=PromptMemo(settings.writer_memo_max_bytes, settings.writer_memo_max_entries),
        replay=ReplayChunks(
            settings.journal_replay_chunk_bytes, timeout_s=settings.writer_write_timeout_s
        ),
        unstored_max_ids=settings.writer_unstored_max_ids,
    )
    recorder.start()
    keys = KeyRing(
        [k.get_secret_value() for k in settings.api_keys],
        sessionmaker,
        refresh_s=settings.keys_refresh_s,
    )
    if settings.auth_on:
        await keys.start()
    alias = PolicyAlias(
        settings.policy_alias,
        sessionmaker,
        upstream,
        base_model=settings.base_model,
        refresh_s=settings.alias_refresh_s,
        lineages=settings.adapter_per_agent,
        shares=settings.shares,
        listen_url=database.libpq_url(url),
        snapshot=settings.home / "policy-alias.json",
    )
    await alias.start()
    keeper = ReplicaKeeper(upstream, alias, probe_s=settings.replica_probe_s)
    await keeper.start()
    quotas = Quotas(settings) if Quotas.wanted(settings) else None
    share = QuotaShare(quotas, sessionmaker, settings.quota_heartbeat_s) if quotas else None
    if share is not None:
        await share.start()
    maintenance = Maintenance(settings, url)
    await maintenance.start(after=migrator.wait())
    # The record wing's door (AIR and durable mode are its decisions), and the relay in front.
    check = None if settings.air_penalty is None else ToolCheck(settings.air_tool_call_marker)
    durable_wait_s = settings.durable_wait_s if settings.durable else None
    intake = Intake(recorder, tool_check=check, durable_wait_s=durable_wait_s)
    scorer = Scorer(upstream=upstream, intake=intake)
    handoff = Handoff(intake=intake, upstream=upstream, scorer=scorer)
    to_providers = None
    if providers is not None:
        to_providers = ProviderForwarder(
            providers=providers,
            handoff=handoff,
            max_n=settings.route_max_n,
            max_body_bytes=settings.route_max_body_bytes,
        )
    forwarder = Forwarder(upstream=upstream, alias=alias, handoff=handoff, providers=to_providers)
    try:
        yield Services(
            settings=settings,
            sessionmaker=sessionmaker,
            writer_sessions=writer_sessions,
            reward_sessions=reward_sessions,
            recorder=recorder,
            upstream=upstream,
            alias=alias,
            forwarder=forwarder,
            keys=keys,
            migrator=migrator,
            quotas=quotas,
            spans=spans,
            export_slots=ExportSlots(settings.exports_max, settings.exports_per_tenant),
        )
    finally:
        # uvicorn gave the calls in flight shutdown_drain_s; all of this fits in shutdown_flush_s.
        deadline = time.monotonic() + settings.shutdown_flush_s
        await maintenance.stop()  # at once, even in the middle of a round
        if share is not None:
            await share.stop()  # its share goes to the other replicas
        await migrator.stop()
        await keys.stop()
        await keeper.stop()
        # Scoring in flight gets part of the flush; its records go to the writer however it ends.
        await scorer.stop(settings.shutdown_flush_s * SCORING_SHARE)
        await alias.stop()
        await recorder.stop(max(0.0, deadline - time.monotonic()))
        if spans is not None:
            await asyncio.to_thread(spans.close)  # exports what is queued
        await upstream.close()
        await engine.dispose()
        await writer_engine.dispose()
        await reward_engine.dispose()


def services_of(app: FastAPI) -> Services:
    return cast(Services, app.state.services)  # set by create_app's lifespan


def _services(request: Request) -> Services:
    return services_of(request.app)


ServicesDep = Annotated[Services, Depends(_services)]
