"""Who may do what, and how much: keys, the Host check, the operator's keys and every tenant's
quota (proxy/auth.py, proxy/hosts.py, proxy/quotas.py read these).

A quota's limits are declared once, in `Quota`: FLYWHEEL_TENANT_QUOTAS gives some tenants their
own, and `QuotaSettings` (FLYWHEEL_QUOTA_RPS, FLYWHEEL_QUOTA_CONCURRENCY, ...) is made from the
same fields, the default every tenant gets.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, create_model, field_validator
from pydantic_settings import NoDecode

from core import tenants
from core.settings import FlywheelSettings, json_or_short, split_commas

# The Host names a proxy listening on loopback answers to by default (proxy/hosts.py).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


class Quota(BaseModel, extra="forbid", frozen=True):
    """A tenant's limits (proxy/quotas.py), each 0 for none: FLYWHEEL_QUOTA_* for every tenant,
    FLYWHEEL_TENANT_QUOTAS for some. Rates are per second; every limit holds across replicas
    (each proxy grants its share: 1/N of it, N the proxies alive)."""

    rps: float = Field(
        0,
        ge=0,
        description="Completion calls per second a tenant may make (a token bucket holding "
        "quota_burst_s of it); over it: 429 with Retry-After, nothing recorded. 0: no limit. "
        "Every quota holds across replicas: each proxy grants its share (1/N of the N alive).",
    )
    concurrency: int = Field(
        0, ge=0, description="Completion calls a tenant may have in flight (429 beyond). 0: any."
    )
    rewards_rps: float = Field(
        0,
        ge=0,
        description="Reward and demonstration posts (POST /v1/rewards, /v1/demonstrations) per "
        "second a tenant may make. 0: any.",
    )
    reads_rps: float = Field(
        0,
        ge=0,
        description="Reads per second a tenant may make: GET /v1/episodes/*, /v1/export, "
        "/ui/api/* (not the operator's dashboard: the admin key, or auth off). 0: any.",
    )
    burst_s: float = Field(
        1.0,
        gt=0,
        description="Each rate's burst: after idling, a tenant may send this many seconds' worth "
        "at once (at least one request).",
    )


def _quota_fields() -> dict[str, Any]:
    """Quota's limits as settings: `rps` is FLYWHEEL_QUOTA_RPS, its bounds and description the
    same."""
    return {
        f"quota_{name}": (field.annotation, copy.deepcopy(field))
        for name, field in Quota.model_fields.items()
    }


# Every tenant's default quota, one setting per limit of `Quota` (ProxySettings.quota reads them).
QuotaSettings = create_model(  # (a class made from Quota's fields: they are declared once)
    "QuotaSettings", __base__=FlywheelSettings, **_quota_fields()
)


class AccessSettings(FlywheelSettings):
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

    _split_access = field_validator("api_keys", "allowed_hosts", mode="before")(split_commas)

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

    @field_validator("tenant_quotas", mode="before")
    @classmethod
    def _parse_quotas(cls, value: object) -> object:
        """`acme:rps=5,concurrency=2;beta:rps=50` (or JSON) -> {tenant: {limit: value}}."""
        return json_or_short(value, _short_quotas)

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

    @property
    def auth_on(self) -> bool:
        return self.auth == "keys" or bool(self.api_keys)

    @property
    def ops_keys_on(self) -> bool:
        """Whether /metrics and /healthz's detail need the metrics (or admin) key."""
        return self.auth_on or self.metrics_key is not None


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _short_quotas(value: str) -> dict[str, dict[str, str]]:
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
