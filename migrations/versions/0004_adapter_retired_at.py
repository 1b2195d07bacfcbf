"""adapter_version.retired_at: retirement recorded in Postgres, not read off the trainer's disk.

Before, "retired" meant "its directory is gone", which only the trainer's host can see: a proxy
without the adapters volume (compose, Kubernetes) refused to roll back to any version not loaded
in vLLM. Versions retired before this migration have their directory gone but no mark; the trainer
marks them at its next retirement pass (unloading a name vLLM no longer has is a no-op).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "adapter_version", sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("adapter_version", "retired_at")
