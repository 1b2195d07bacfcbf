"""Where calls go: the vLLM replicas, which adapter lineage serves a call, the providers routed
through litellm, and how long a call may take (proxy/relay/ reads these).
"""

from __future__ import annotations

import os
import re
from typing import Annotated

from pydantic import BaseModel, ByteSize, Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from core import naming
from core.settings import FlywheelSettings, json_or_short, split_commas, vllm_base_urls
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


class RelaySettings(FlywheelSettings):
    upstream: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="vLLM base URL(s), e.g. http://127.0.0.1:8001 (no /v1). Several = replicas.",
    )
    upstream_api_key: SecretStr | None = Field(None, description="Bearer key sent to vLLM.")
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
    replica_probe_s: float = Field(
        2.0,
        gt=0,
        description="How often each vLLM replica is probed (ejected ones rejoin on an answer).",
    )
    policy_alias: str = Field("policy", description="Model name that follows the trained adapter.")
    alias_refresh_s: float = Field(
        0.5,
        gt=0,
        description="Fallback poll of the current adapter version (a NOTIFY moves it at once).",
    )
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

    _split_relay = field_validator("upstream", "shared_lineages", mode="before")(split_commas)

    @field_validator("upstream")
    @classmethod
    def _check_upstream(cls, urls: list[str]) -> list[str]:
        return vllm_base_urls(urls, "upstream")

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
            naming.check_role(lineage)
        return lineages

    @field_validator("routes", mode="before")
    @classmethod
    def _parse_routes(cls, value: object) -> object:
        """`name=provider/model,...` or a JSON object of name -> model string or route."""
        routes = json_or_short(value, _short_routes)
        if routes is value:  # not text: pydantic checks it
            return value
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


def _short_routes(value: str) -> dict[str, str]:
    routes = {}
    for entry in filter(None, (part.strip() for part in value.split(","))):
        name, sep, model = entry.partition("=")
        if not sep:
            raise ValueError(f"{entry!r} is not name=provider/model")
        routes[name.strip()] = model.strip()
    return routes
