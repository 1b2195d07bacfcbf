"""Settings of the proxy process, built once at start-up and passed down.

Every field is also an environment variable with the `FLYWHEEL_` prefix (e.g. `FLYWHEEL_UPSTREAM`).
Lists (`upstream`, `api_keys`) are comma-separated in the environment. Where the database is
(`FLYWHEEL_DATABASE_URL`, `FLYWHEEL_HOME`) is `core/settings.py`, shared with the trainer.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ByteSize, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from core import codecs, policy, tenants
from core.settings import DatabaseSettings, split_commas, vllm_base_urls
from core.tenants import TENANT_PATTERN

# No `/`: a tenant's ids are stored as `<tenant>/<id>` (core/tenants.py), so no tag names another's.
TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}$"


class ProviderModel(BaseModel, extra="forbid", frozen=True):
    """A provider model: a model name the proxy sends to a provider through litellm
    (FLYWHEEL_ROUTES)."""

    model: str = Field(pattern=r"^[A-Za-z0-9_.-]+/.+$")  # litellm's `<provider>/<model>`
    api_base: str | None = None  # default: the provider's
    # The environment variable holding its key; default: litellm's own (OPENAI_API_KEY, ...).
    api_key_env: str | None = None
    input_cost_per_token: float | None = Field(None, ge=0)  # USD, where litellm has no price
    output_cost_per_token: float | None = Field(None, ge=0)

    @property
    def provider(self) -> str:
        return self.model.split("/", 1)[0]


class Quota(BaseModel, extra="forbid", frozen=True):
    """A tenant's limits (proxy/quotas.py), each 0 for none: FLYWHEEL_QUOTA_* for every tenant,
    FLYWHEEL_TENANT_QUOTAS for some. Rates are per second, per proxy process."""

    rps: float = Field(0, ge=0)  # completion calls (every wire.ENDPOINTS route)
    concurrency: int = Field(0, ge=0)  # completion calls in flight
    rewards_rps: float = Field(0, ge=0)  # POST /v1/rewards and /v1/demonstrations
    reads_rps: float = Field(0, ge=0)  # GET /v1/episodes/*, /v1/export, /ui/api/*
    burst_s: float = Field(1.0, gt=0)  # each rate's bucket holds this many seconds of it


# The Host names a proxy listening on loopback answers to by default (proxy/hosts.py).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


class ProxySettings(DatabaseSettings):
    upstream: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="vLLM base URL(s), e.g. http://127.0.0.1:8001 (no /v1). Several = replicas.",
    )
    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port the proxy listens on.")
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Keys of the default tenant (every scope). Set, or auth=keys: every /v1/* "
        "call needs `Authorization: Bearer <key>`.",
    )
    auth: Literal["off", "keys"] = Field(
        "off",
        description="keys: every /v1/* call needs a key, from api_keys or from `flywheel keys "
        "create` (per tenant, scoped, stored hashed). Set api_keys implies keys.",
    )
    keys_refresh_s: float = Field(
        2.0, gt=0, description="How often the keys table is re-read (a revoked key stops then)."
    )
    quota_rps: float = Field(
        0,
        ge=0,
        description="Completion calls per second a tenant may make (a token bucket holding "
        "quota_burst_s of it); over it: 429 with Retry-After, nothing recorded. 0: no limit. "
        "Every quota holds across replicas: each proxy grants its share (1/N of the N alive).",
    )
    quota_concurrency: int = Field(
        0, ge=0, description="Completion calls a tenant may have in flight (429 beyond). 0: any."
    )
    quota_rewards_rps: float = Field(
        0,
        ge=0,
        description="Reward and demonstration posts (POST /v1/rewards, /v1/demonstrations) per "
        "second a tenant may make. 0: any.",
    )
    quota_reads_rps: float = Field(
        0,
        ge=0,
        description="Reads per second a tenant may make: GET /v1/episodes/*, /v1/export, "
        "/ui/api/* (not the operator's dashboard: the admin key, or auth off). 0: any.",
    )
    quota_burst_s: float = Field(
        1.0,
        gt=0,
        description="Each rate's burst: after idling, a tenant may send this many seconds' worth "
        "at once (at least one request).",
    )
    quota_heartbeat_s: float = Field(
        2.0,
        gt=0,
        le=300,
        description="How often each proxy (with any quota set) beats its heartbeat into Postgres "
        "and counts the proxies alive, whose number divides every quota.",
    )
    tenant_quotas: Annotated[dict[str, Quota], NoDecode] = Field(
        default_factory=dict,
        description="Quotas of some tenants, over the FLYWHEEL_QUOTA_* every tenant gets: "
        "`acme:rps=5,concurrency=2;beta:rps=50,reads_rps=0` (limits rps, concurrency, "
        "rewards_rps, reads_rps, burst_s; 0: none; `default`: the tenant of FLYWHEEL_API_KEYS), "
        'or JSON: `{"acme": {"rps": 5}}`.',
    )
    dangerously_serve_without_keys: bool = Field(
        False,
        description="Listen on a non-loopback address with auth off: anyone who can reach the "
        "port reads every transcript and posts rewards. Refused unless this is set.",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host names the proxy answers to (the Host header, any port), "
        "comma-separated; `*.example.com` for its subdomains, `*` for any. Unset: localhost, "
        "127.0.0.1 and [::1] when listening on loopback (so a web page cannot reach it by DNS "
        "rebinding), any name otherwise. /livez, /healthz and /metrics answer to any.",
    )
    upstream_api_key: SecretStr | None = Field(None, description="Bearer key sent to vLLM.")
    admin_key: SecretStr | None = Field(
        None, description="Bearer key for /admin/* (adapter rollback); unset: admin is off."
    )
    metrics_key: SecretStr | None = Field(
        None,
        description="Bearer key for GET /metrics and /healthz's detail (Prometheus' scrape; the "
        "admin key works too). With keys on, or this set, /metrics needs one of the two and "
        "/healthz without a key answers its status alone (the probes); unset with keys off: "
        "both open.",
    )
    policy_alias: str = Field("policy", description="Model name that follows the trained adapter.")
    adapter_per_agent: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Agents (X-Agent-Name) whose `policy` calls are served by an adapter lineage "
        "of their own, each trained by its own trainer (FLYWHEEL_LINEAGE): `writer,rewriter` "
        "(a lineage per agent, named after it) or `sql=writer+rewriter` (one lineage for a "
        "group). Other agents get the default lineage `policy`.",
    )
    shared_lineages: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Tenants served by, and training, the shared lineages (`policy`, and each "
        "FLYWHEEL_ADAPTER_PER_AGENT lineage) instead of their own (`<tenant>.policy`): tenant "
        "names, comma-separated, or `*` for every tenant. Empty: each tenant's calls are served "
        "and trained apart from every other tenant's.",
    )
    base_model: str | None = Field(
        None,
        description="Model the alias serves before any adapter exists (default: vLLM's first).",
    )
    # The provider models. `routes` (FLYWHEEL_ROUTES, FLYWHEEL_ROUTE_*) is the settings' name from
    # before; everywhere else in the proxy a route is one of its own HTTP routes.
    routes: Annotated[dict[str, ProviderModel], NoDecode] = Field(
        default_factory=dict,
        description="Model names served by providers through litellm, not by vLLM "
        "(proxy/relay/providers.py): `gpt-4.1=openai/gpt-4.1,claude=anthropic/claude-sonnet-4-5`, "
        'or JSON for more: `{"gpt-4.1": {"model": "openai/gpt-4.1", "api_base": "...", '
        '"api_key_env": "TEAM_OPENAI_KEY"}}`. Their chat calls are recorded (no token ids, '
        "never trained). Needs the `litellm` extra (the proxy image has it).",
    )
    route_timeout_s: float = Field(600.0, gt=0, description="One routed call's time limit.")
    route_retries: int = Field(
        0, ge=0, description="litellm's retries of a routed call that failed before answering."
    )
    route_max_n: int = Field(
        8,
        ge=1,
        description="Most choices (`n`) one routed call may ask a provider for, on the "
        "operator's key; more is a 400.",
    )
    route_max_body_bytes: ByteSize = Field(
        ByteSize(4 * 2**20),
        ge=1,
        description="Largest request body (e.g. 4MiB) a routed call may send a provider; "
        "larger is a 413 (FLYWHEEL_MAX_BODY_BYTES bounds every call).",
    )
    keep_alive_s: int = Field(
        65,
        ge=1,
        description="How long an idle client connection is kept open. Longer than the clients' "
        "own idle expiry (httpx, which openai-python uses: 5 s) and load balancers' (often 60 s), "
        "so they close first: a server closing at the same moment races their next request.",
    )
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="Larger request bodies get 413.")
    upstream_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Total time allowed for one upstream call (generation can be slow).",
    )
    upstream_dead_after_s: float = Field(
        30.0,
        ge=1,
        le=86_400,  # a day: beyond it no partition is worth waiting out (and TCP caps probes)
        description="A connection to vLLM whose packets go unanswered this long (a network "
        "partition, a vanished host) is dropped: the call goes to another replica, a stream "
        "under way ends failed. TCP keepalives probe it, so a long silent generation is not cut.",
    )
    credit_gamma: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Discount for credit assignment; unset = identical assignment (paper default).",
    )
    air_penalty: float | None = Field(
        None,
        ge=0,
        description="Automatic intermediate rewards (proxy/record/air.py): a transition whose tool "
        "call names an undeclared tool, has non-JSON arguments or breaks the tool's schema gets an "
        "intermediate reward of minus this. Unset: AIR off (0: check and record, no penalty).",
    )
    air_tool_call_marker: str = Field(
        "<tool_call>",
        description="Text that starts a tool call in the served model's output (Hermes/Qwen: "
        "<tool_call>); seen with no call parsed, AIR counts an unparsed call. Empty: not checked.",
    )
    otel_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces): every recorded "
        "call is also exported as an OpenTelemetry span in its episode's trace "
        "(proxy/record/tracing.py). Unset: off.",
    )
    otel_service_name: str = Field("flywheel-proxy", description="The spans' service.name.")
    retention_days: int | None = Field(
        None,
        ge=1,
        description="Drop recorded days older than this many whole UTC days (core/retention.py;"
        " days a trainer has not used yet are kept). Unset: keep everything. The command "
        "`flywheel retain` does the same by hand.",
    )
    retention_archive_dir: Path | None = Field(
        None,
        description="With FLYWHEEL_RETENTION_DAYS: export each day to DIR/<partition>.parquet "
        "(with token ids) before dropping it.",
    )
    maintenance_s: float = Field(
        3600.0,
        gt=0,
        description="How often one proxy makes the coming days' partitions of `transition` "
        "(core/partitions.py) and applies FLYWHEEL_RETENTION_DAYS; also once at start-up.",
    )
    writer_batch_size: int = Field(500, ge=1, description="Most transitions per database write.")
    writer_linger_s: float = Field(
        0.05,
        ge=0,
        le=5,
        description="At low load, how long a recorded transition may wait for others to share "
        "its database write (one write costs about the same for 1 as for 10). Rewards, episode "
        "reads, durable mode and shutdown write at once; 0 writes every call on its own.",
    )
    journal_retry_s: float = Field(
        1.0, gt=0, description="While Postgres is unreachable, how often a journal replay is tried."
    )
    writer_queue_max_bytes: ByteSize = Field(
        ByteSize(256 * 2**20),
        ge=1,
        description="Memory the writer's queue may hold (e.g. 256MiB) before it spills to the "
        "journal: a slow database must not get the proxy OOM-killed with its queue.",
    )
    writer_memo_max_bytes: ByteSize = Field(
        ByteSize(codecs.PROMPT_MEMO_BYTES),
        ge=0,
        description="Memory the writer's memo of each episode's last prompt may hold (its "
        "digests, so that the next call hashes only what is new); 0 turns it off.",
    )
    writer_memo_max_entries: int = Field(
        codecs.PROMPT_MEMO_ENTRIES,
        ge=0,
        description="Most episodes the writer's prompt memo keeps, the least recently used "
        "forgotten first, episodes of one call (no X-Episode-Id) before conversations.",
    )
    writer_write_timeout_s: float = Field(
        15.0,
        gt=0,
        description="A database write taking longer is an outage: its transitions go to the "
        "journal. Journal replays size their chunks to finish well within it.",
    )
    journal_replay_chunk_bytes: ByteSize = Field(
        ByteSize(32 * 2**20),
        ge=1,
        description="Most transitions' memory (as FLYWHEEL_WRITER_QUEUE_MAX_BYTES counts it) "
        "replayed from the journal in one transaction; halved while writes are slow.",
    )
    writer_pool_size: int = Field(
        4,
        ge=1,
        description="Database connections kept for the writer alone (recording, journal "
        "replays, rewards), up to as many again in bursts; readers (dashboard, episodes, export, "
        "admin) have a pool of their own, so no reader can make recording wait or spill to the "
        "journal.",
    )
    reward_pool_size: int = Field(
        4,
        ge=1,
        description="Database connections for reward and demonstration posts, up to as many "
        "again in bursts: a pool of their own, so posts queued on one episode's row lock cannot "
        "take the writer's connections and make recording spill to the journal.",
    )
    read_timeout_s: float = Field(
        15.0,
        gt=0,
        description="Longest one read statement may run (dashboard, episode reads, admin, each "
        "fetch of an export) before Postgres cancels it (statement_timeout, set per read "
        "transaction): a 503 that says what to narrow. The writer is not bounded by it.",
    )
    exports_max: int = Field(
        2,
        ge=1,
        description="GET /v1/export streams running at once per proxy (each holds a reader "
        "connection); beyond it, 429.",
    )
    exports_per_tenant: int = Field(
        1,
        ge=1,
        description="Of those, how many one tenant may run at once (429 beyond), so one tenant "
        "cannot take every export slot.",
    )
    export_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="An export whose client reads nothing for this long is ended and its slot "
        "freed (a client that stops reading cannot hold one).",
    )
    writer_unstored_max_ids: int = Field(
        50_000,
        ge=0,
        description="Journaled transitions the writer tracks one by one (~0.5 KB each) for "
        "rewards and episode reads; past it, a 1 MiB summary that may answer 'not stored yet' "
        "(a 503 to retry) until the journal is replayed.",
    )
    durable: bool = Field(
        False,
        description="Release a successful answer only once its transitions are committed or "
        "fsync'd to the journal, so not even kill -9 loses an answered call (costs latency: "
        "docs/benchmarks.md, durable mode).",
    )
    durable_wait_s: float = Field(
        30.0,
        gt=0,
        description="Durable mode: release the answer anyway after this long (Postgres and the "
        "journal both failing), counted in flywheel_durable_timeouts_total.",
    )
    shutdown_drain_s: float = Field(
        20.0,
        gt=0,
        description="On SIGTERM, how long calls in flight may take to finish (uvicorn's graceful "
        "shutdown) before they are cut.",
    )
    shutdown_flush_s: float = Field(
        10.0,
        gt=0,
        description="Then how long the rest of the shutdown may take: scoring in flight (half of "
        "it at most), then the writer getting its queue into Postgres before the rest goes to "
        "the journal. The pod's termination grace must exceed drain + flush.",
    )
    replica_probe_s: float = Field(
        2.0,
        gt=0,
        description="How often each vLLM replica is probed (ejected ones rejoin on an answer).",
    )
    alias_refresh_s: float = Field(
        0.5,
        gt=0,
        description="Fallback poll of the current adapter version (a NOTIFY moves it at once).",
    )

    _split = field_validator(
        "upstream", "api_keys", "allowed_hosts", "shared_lineages", mode="before"
    )(split_commas)

    @field_validator("shared_lineages")
    @classmethod
    def _check_shared(cls, tenants: list[str]) -> list[str]:
        for tenant in tenants:
            if tenant != "*" and not re.fullmatch(TENANT_PATTERN, tenant):
                raise ValueError(f"{tenant!r} is not a tenant name (or `*`, every tenant)")
        return tenants

    def shares(self, tenant: str | None) -> bool:
        """Whether `tenant`'s calls go to the shared lineages (the default tenant's always do)."""
        return tenant is None or "*" in self.shared_lineages or tenant in self.shared_lineages

    @field_validator("allowed_hosts")
    @classmethod
    def _check_hosts(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(r"\*|(\*\.)?[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]", name):
                raise ValueError(
                    f"FLYWHEEL_ALLOWED_HOSTS: {name!r} is not a host name: give names without "
                    "scheme or port (any port is allowed), e.g. proxy.example.com,*.internal,"
                    "[::1], or * for any"
                )
        return names

    @field_validator("adapter_per_agent", mode="before")
    @classmethod
    def _parse_lineages(cls, value: object) -> object:
        """`writer,rewriter` or `sql=writer+rewriter,judge` -> {agent: lineage}."""
        if not isinstance(value, str):
            return value
        lineages: dict[str, str] = {}
        for entry in filter(None, (part.strip() for part in value.split(","))):
            lineage, _, agents = entry.partition("=")
            for agent in (agents or lineage).split("+"):
                agent = agent.strip()
                if agent in lineages:
                    raise ValueError(f"agent {agent!r} is given two lineages")
                lineages[agent] = lineage.strip()
        return lineages

    @field_validator("adapter_per_agent")
    @classmethod
    def _check_lineages(cls, lineages: dict[str, str]) -> dict[str, str]:
        for agent, lineage in lineages.items():
            if not re.fullmatch(TAG_PATTERN, agent):
                raise ValueError(f"{agent!r} is not an agent name (X-Agent-Name)")
            policy.check_role(lineage)
        return lineages

    @field_validator("tenant_quotas", mode="before")
    @classmethod
    def _parse_quotas(cls, value: object) -> object:
        """`acme:rps=5,concurrency=2;beta:rps=50` (or JSON) -> {tenant: {limit: value}}."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("{"):
            try:
                return orjson.loads(value)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from e
        quotas: dict[str, dict[str, str]] = {}
        for entry in filter(None, (part.strip() for part in value.split(";"))):
            tenant, sep, limits = (p.strip() for p in entry.partition(":"))
            pairs = [pair.partition("=") for pair in limits.split(",")]
            if not sep or not all(k.strip() and eq and v.strip() for k, eq, v in pairs):
                raise ValueError(
                    f"{entry!r} is not tenant:limit=value,...: e.g. acme:rps=5,concurrency=2"
                )
            if tenant in quotas:
                raise ValueError(f"tenant {tenant!r} is given quotas twice")
            unknown = [k.strip() for k, _, _ in pairs if k.strip() not in Quota.model_fields]
            if unknown:
                raise ValueError(
                    f"{tenant}: no limit is called {unknown[0]!r} "
                    f"(the limits: {', '.join(Quota.model_fields)})"
                )
            quotas[tenant] = {k.strip(): v.strip() for k, _, v in pairs}
        return quotas

    @field_validator("tenant_quotas")
    @classmethod
    def _check_quotas(cls, quotas: dict[str, Quota]) -> dict[str, Quota]:
        for tenant in quotas:
            if tenant != "default" and not re.fullmatch(tenants.TENANT_PATTERN, tenant):
                raise ValueError(
                    f"{tenant!r} is not a tenant name (1-32 of a-z 0-9 _ -, as `flywheel keys "
                    "create --tenant` takes; `default` for FLYWHEEL_API_KEYS' tenant)"
                )
        return quotas

    @field_validator("routes", mode="before")
    @classmethod
    def _parse_routes(cls, value: object) -> object:
        """`name=provider/model,...` or a JSON object of name -> model string or route."""
        if not isinstance(value, str):
            return value
        if value.lstrip()[:1] in ("{", "["):
            try:
                routes = orjson.loads(value)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from e
        else:
            routes = {}
            for entry in filter(None, (part.strip() for part in value.split(","))):
                name, sep, model = entry.partition("=")
                if not sep:
                    raise ValueError(f"{entry!r} is not name=provider/model")
                routes[name.strip()] = model.strip()
        if not isinstance(routes, dict):
            raise ValueError("a JSON route list must be an object of model name -> route")
        return {k: {"model": v} if isinstance(v, str) else v for k, v in routes.items()}

    @field_validator("routes")
    @classmethod
    def _check_routes(cls, routes: dict[str, ProviderModel]) -> dict[str, ProviderModel]:
        for name, provider_model in routes.items():
            if not name or len(name) > 200:
                raise ValueError(f"{name!r} is not a model name")
            key_env = provider_model.api_key_env
            if key_env is not None and not os.environ.get(key_env):
                raise ValueError(
                    f"route {name!r}: the environment variable {key_env} "
                    "(its api_key_env) is not set"
                )
        return routes

    @field_validator("upstream")
    @classmethod
    def _check_upstream(cls, urls: list[str]) -> list[str]:
        return vllm_base_urls(urls, "upstream")

    @property
    def auth_on(self) -> bool:
        return self.auth == "keys" or bool(self.api_keys)

    @property
    def ops_keys_on(self) -> bool:
        """Whether /metrics and /healthz's detail need the metrics (or admin) key."""
        return self.auth_on or self.metrics_key is not None

    @model_validator(mode="after")
    def _exports_fit(self) -> ProxySettings:
        if self.exports_per_tenant > self.exports_max:
            raise ValueError(
                f"FLYWHEEL_EXPORTS_PER_TENANT ({self.exports_per_tenant}) exceeds "
                f"FLYWHEEL_EXPORTS_MAX ({self.exports_max}): lower it or raise the other"
            )
        return self

    @model_validator(mode="after")
    def _routes_leave_the_alias_alone(self) -> ProxySettings:
        if self.policy_alias in self.routes:
            raise ValueError(
                f"FLYWHEEL_ROUTES routes {self.policy_alias!r}, the policy alias: "
                "the trained policy would never be served"
            )
        return self

    @model_validator(mode="after")
    def _refuse_an_open_network_proxy(self) -> ProxySettings:
        if (
            not self.auth_on
            and not _loopback(self.host)
            and not self.dangerously_serve_without_keys
        ):
            raise ValueError(
                f"refusing to listen on {self.host} without API keys: anyone who can reach it "
                "would read every transcript and post rewards. Set FLYWHEEL_API_KEYS (or "
                "FLYWHEEL_AUTH=keys and `flywheel keys create`), listen on 127.0.0.1, or set "
                "FLYWHEEL_DANGEROUSLY_SERVE_WITHOUT_KEYS=true if a network policy guards it."
            )
        return self

    @property
    def host_names(self) -> list[str]:
        """The Host names it answers to (FLYWHEEL_ALLOWED_HOSTS, or its default: proxy/hosts.py)."""
        if self.allowed_hosts:
            return self.allowed_hosts
        return list(LOOPBACK_NAMES) if _loopback(self.host) else ["*"]

    @property
    def journal_dir(self) -> Path:
        return self.home / "journal"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
