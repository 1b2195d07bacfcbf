"""Trainer: claim leases, skip reasons, a version sequence, per-version stats.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

OLD_TRAINABLE = "status = 'ok' AND credited_at IS NOT NULL AND trained_at IS NULL"
NEW_TRAINABLE = OLD_TRAINABLE + " AND skip_reason IS NULL"


def upgrade() -> None:
    op.add_column("transition", sa.Column("claimed_by", sa.Text(), nullable=True))
    op.add_column(
        "transition", sa.Column("claim_expires_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("transition", sa.Column("skip_reason", sa.Text(), nullable=True))
    op.add_column("transition", sa.Column("trained_version", sa.Integer(), nullable=True))
    op.drop_index("ix_transition_trainable", table_name="transition")
    op.create_index(
        "ix_transition_trainable",
        "transition",
        ["credited_at"],
        postgresql_where=sa.text(NEW_TRAINABLE),
    )
    op.add_column(
        "adapter_version",
        sa.Column("trained_transitions", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column(
        "adapter_version",
        sa.Column("stats", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )
    # Versions come from a sequence: two trainers can never publish the same policy-vN.
    op.execute("CREATE SEQUENCE adapter_version_seq OWNED BY adapter_version.version")
    op.execute(
        "SELECT setval('adapter_version_seq', "
        "coalesce((SELECT max(version) FROM adapter_version), 0) + 1, false)"
    )
    op.execute(
        "ALTER TABLE adapter_version ALTER COLUMN version "
        "SET DEFAULT nextval('adapter_version_seq')"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE adapter_version ALTER COLUMN version DROP DEFAULT")
    op.execute("DROP SEQUENCE adapter_version_seq")
    op.drop_column("adapter_version", "stats")
    op.drop_column("adapter_version", "trained_transitions")
    op.drop_index("ix_transition_trainable", table_name="transition")
    op.create_index(
        "ix_transition_trainable",
        "transition",
        ["credited_at"],
        postgresql_where=sa.text(OLD_TRAINABLE),
    )
    op.drop_column("transition", "trained_version")
    op.drop_column("transition", "skip_reason")
    op.drop_column("transition", "claim_expires_at")
    op.drop_column("transition", "claimed_by")
