"""Settings every process shares: where the data lives. Each process's own settings class
(`proxy/config/`, `trainer/config/`) extends `DatabaseSettings`; it is built once at start-up
and passed down. Every field is also a `FLYWHEEL_*` environment variable.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def split_commas(value: object) -> object:
    """Lists are comma-separated in the environment (`FLYWHEEL_UPSTREAM=http://a,http://b`)."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def json_or_short(value: object, short: Callable[[str], object]) -> object:
    """A setting given as JSON (an object or a list) or in its short text form, which `short`
    parses (FLYWHEEL_ROUTES, FLYWHEEL_TENANT_QUOTAS); a value that is not text is left as is."""
    if not isinstance(value, str):
        return value
    if value.lstrip()[:1] in ("{", "["):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from e
    return short(value)


def vllm_base_urls(urls: list[str], name: str) -> list[str]:
    """vLLM URLs as every process keeps them: http(s), without a trailing `/` or `/v1`."""
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{name} {url!r} must start with http:// or https://")
    return [url.rstrip("/").removesuffix("/v1") for url in urls]


class FlywheelSettings(BaseSettings):
    """Every settings class's base: its fields are FLYWHEEL_* variables. A process's settings may
    be assembled from several, one per concern (proxy/config/)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", extra="ignore")


class DatabaseSettings(FlywheelSettings):
    """What the proxy and the trainer share: where the data lives."""

    home: Path = Field(Path(".flywheel"), description="Data directory: embedded Postgres, journal.")
    database_url: str | None = Field(
        None,
        description="Postgres URL (postgresql://...). Unset: an embedded Postgres under `home`.",
    )
    require_database_url: bool = Field(
        False, description="Refuse to start the embedded Postgres (set in deployments)."
    )
    log_level: str = Field("info", description="Python log level.")

    @model_validator(mode="after")
    def _check_database(self) -> DatabaseSettings:
        if self.require_database_url and not self.database_url:
            raise ValueError(
                "FLYWHEEL_DATABASE_URL is required here (FLYWHEEL_REQUIRE_DATABASE_URL is set); "
                "set it to your Postgres URL, e.g. postgresql://user:pass@host:5432/flywheel"
            )
        return self
