"""Prometheus metrics of the proxy (served at GET /metrics). One place, so names stay consistent."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_OVERHEAD_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)

requests = Counter("flywheel_requests_total", "HTTP requests served.", ["route", "status"])
quota_refusals = Counter(
    "flywheel_quota_refusals_total",
    "Requests refused (429) over a tenant's quota, by tenant and limit (rps, concurrency, "
    "rewards_rps, reads_rps: proxy/quotas.py).",
    ["tenant", "limit"],
)
quota_replicas = Gauge(
    "flywheel_quota_replicas",
    "Proxies alive by their heartbeats, sharing each tenant's quota (each grants 1/N of it).",
)
upstream_latency = Histogram(
    "flywheel_upstream_latency_seconds",
    "Time from sending to vLLM until its response ended.",
    ["route"],
    buckets=_LATENCY_BUCKETS,
)
proxy_overhead = Histogram(
    "flywheel_proxy_overhead_seconds",
    "Time spent in the proxy itself per completion call (total minus upstream).",
    ["route"],
    buckets=_OVERHEAD_BUCKETS,
)
provider_calls = Counter(  # (the metric keeps its name from before: "routed")
    "flywheel_routed_calls_total",
    "Calls of FLYWHEEL_ROUTES models, sent to their providers through litellm.",
    ["model", "status"],
)
provider_cost = Counter(
    "flywheel_routed_cost_usd_total", "litellm's price of the routed calls, USD.", ["model"]
)
transitions_recorded = Counter(
    "flywheel_transitions_recorded_total", "Transitions written to Postgres.", ["status"]
)
transitions_journaled = Counter(
    "flywheel_transitions_journaled_total", "Transitions written to the disk journal."
)
transitions_rejected = Counter(
    "flywheel_transitions_rejected_total",
    "Transitions Postgres refused as data (kept in the journal's rejected/ folder).",
)
writer_queue_depth = Gauge(
    "flywheel_writer_queue_depth", "Transitions waiting in memory for the background writer."
)
writer_unsaved = Gauge(
    "flywheel_writer_unsaved_transitions",
    "Transitions answered but neither in Postgres nor in the journal yet (queued, or in a batch "
    "being written): what a kill -9 would lose now, unless FLYWHEEL_DURABLE.",
)
durable_timeouts = Counter(
    "flywheel_durable_timeouts_total",
    "Durable mode: responses released before their transitions were committed or journaled.",
)
writer_queue_bytes = Gauge(
    "flywheel_writer_queue_bytes",
    "About how much memory the writer's queue holds; past FLYWHEEL_WRITER_QUEUE_MAX_BYTES it "
    "spills to the journal.",
)
writer_memo_bytes = Gauge(
    "flywheel_writer_memo_bytes",
    "What the writer's prompt memo holds (core/codecs.py PromptMemo), at most "
    "FLYWHEEL_WRITER_MEMO_MAX_BYTES.",
)
journal_pending = Gauge(
    "flywheel_journal_pending", "Transitions in the disk journal not yet replayed into Postgres."
)
journal_quarantined = Counter(
    "flywheel_journal_quarantined_lines_total",
    "Journal lines that did not parse (their segment is kept in the journal's quarantine/).",
)
journal_errors = Counter(
    "flywheel_journal_errors_total",
    "Journal operations that failed (disk full, read-only, I/O error); records stay in memory.",
    ["operation"],
)
journal_ok = Gauge("flywheel_journal_ok", "0 while the last journal operation failed.")
database_up = Gauge("flywheel_database_up", "1 when the last database write succeeded.")
rewards_ingested = Counter(
    "flywheel_rewards_ingested_total", "Rewards accepted.", ["kind", "outcome"]
)
replica_up = Gauge("flywheel_replica_up", "1 while a vLLM replica is in rotation.", ["replica"])
replica_outstanding = Gauge(
    "flywheel_replica_outstanding", "Calls sent to a vLLM replica and not finished.", ["replica"]
)
replica_ejections = Counter(
    "flywheel_replica_ejections_total",
    "Times a vLLM replica was taken out of rotation.",
    ["replica"],
)
upstream_retries = Counter(
    "flywheel_upstream_retries_total",
    "Calls sent again to another replica because the first could not be reached.",
)
logprobs_scored = Counter(
    "flywheel_logprobs_scored_total",
    "Transitions whose missing logprobs the proxy asked vLLM for (proxy/relay/scoring.py).",
    ["outcome"],
)
tool_call_errors = Counter(
    "flywheel_tool_call_errors_total",
    "Tool calls AIR found wrong (proxy/record/air.py), by kind; counted only while AIR is on.",
    ["kind"],
)
