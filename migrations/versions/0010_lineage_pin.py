"""Pins (issue 14): `lineage_pin`, a lineage held at one version by hand until unpinned; the
trainer publishes nothing to a pinned lineage and no canary opens on it (core/policy.py).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lineage_pin",
        sa.Column("lineage", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column(
            "pinned_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("note", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("lineage", name=op.f("pk_lineage_pin")),
    )


def downgrade() -> None:
    op.drop_table("lineage_pin")
