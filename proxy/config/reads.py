"""What reads the recorded data back, and what keeps it bounded: read timeouts, exports,
retention and the maintenance round (proxy/routes/, proxy/record/store/ reads these)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from core.settings import FlywheelSettings


class ReadSettings(FlywheelSettings):
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

    @model_validator(mode="after")
    def _exports_fit(self) -> ReadSettings:
        if self.exports_per_tenant > self.exports_max:
            raise ValueError(
                f"FLYWHEEL_EXPORTS_PER_TENANT ({self.exports_per_tenant}) exceeds "
                f"FLYWHEEL_EXPORTS_MAX ({self.exports_max}): lower it or raise the other"
            )
        return self
