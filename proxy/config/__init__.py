"""Settings of the proxy process, built once at start-up and passed down.

One class per concern, each in the module of the wing that reads it: `serve` (where it listens,
request size, shutdown), `access` (keys, hosts, quotas), `relay` (vLLM, lineages, providers),
`record` (writer, journal, durable mode, credit, AIR, spans), `reads` (read timeouts, exports,
retention). `ProxySettings` is all of them with where the data lives (core/settings.py), and
checks what spans two of them.

Every field is also an environment variable with the `FLYWHEEL_` prefix (e.g.
`FLYWHEEL_UPSTREAM`) and a flag of `flywheel proxy` (flywheel/options.py); lists are
comma-separated in the environment. The documentation site's settings reference is generated
from these classes (docs/reference/settings.md).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from core.settings import DatabaseSettings
from proxy.config.access import LOOPBACK_NAMES, AccessSettings, Quota, QuotaSettings, loopback
from proxy.config.reads import ReadSettings
from proxy.config.record import RecordSettings
from proxy.config.relay import TAG_PATTERN, ProviderModel, RelaySettings
from proxy.config.serve import ServeSettings

__all__ = ["TAG_PATTERN", "ProviderModel", "ProxySettings", "Quota"]


# (pydantic takes the fields of the bases last to first: this order is --help's, top to bottom)
class ProxySettings(
    ReadSettings,
    RecordSettings,
    RelaySettings,
    QuotaSettings,  # type: ignore[misc,valid-type]  # made from Quota's fields at import
    AccessSettings,
    ServeSettings,
    DatabaseSettings,
):
    @property
    def quota(self) -> Quota:
        """Every tenant's quota (FLYWHEEL_QUOTA_*), under FLYWHEEL_TENANT_QUOTAS's own."""
        return Quota(**{name: getattr(self, f"quota_{name}") for name in Quota.model_fields})

    @property
    def host_names(self) -> list[str]:
        """The Host names it answers to (FLYWHEEL_ALLOWED_HOSTS, or its default: proxy/hosts.py)."""
        if self.allowed_hosts:
            return self.allowed_hosts
        return list(LOOPBACK_NAMES) if loopback(self.host) else ["*"]

    @property
    def journal_dir(self) -> Path:
        return self.home / "journal"

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
        if not self.auth_on and not loopback(self.host) and not self.dangerously_serve_without_keys:
            raise ValueError(
                f"refusing to listen on {self.host} without API keys: anyone who can reach it "
                "would read every transcript and post rewards. Set FLYWHEEL_API_KEYS (or "
                "FLYWHEEL_AUTH=keys and `flywheel keys create`), listen on 127.0.0.1, or set "
                "FLYWHEEL_DANGEROUSLY_SERVE_WITHOUT_KEYS=true if a network policy guards it."
            )
        return self
