"""Canary releases (issue 14): the `canary` table, and an index per policy version over time.

- `canary`: a candidate adapter version serving a fraction of its lineage's episodes until the
  reward decides; open while `decided_at` is NULL (one open canary per lineage); decided rows are
  the record of every promotion and rollback with its evidence (core/canary.py).
- `ix_transition_policy_version` (policy_version, requested_at): a canary's two arms, and the
  reward per version, read a slice of the index instead of the whole table. Built
  CONCURRENTLY: the proxies keep recording while it builds on a large table.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "canary",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("lineage", sa.Text(), nullable=False),
        sa.Column("candidate", sa.Integer(), nullable=False),
        sa.Column("baseline", sa.Integer(), nullable=False),
        sa.Column("fraction", sa.Double(), nullable=False),
        sa.Column("rule", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "opened_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("action", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("evidence", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.ForeignKeyConstraint(
            ["candidate"],
            ["adapter_version.version"],
            name=op.f("fk_canary_candidate_adapter_version"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_canary")),
    )
    op.create_index(
        "uq_canary_open",
        "canary",
        ["lineage"],
        unique=True,
        postgresql_where=sa.text("decided_at IS NULL"),
    )
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_transition_policy_version",
            "transition",
            ["policy_version", "requested_at"],
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(
            "ix_transition_policy_version",
            table_name="transition",
            postgresql_concurrently=True,
            if_exists=True,
        )
    op.drop_index(
        "uq_canary_open", table_name="canary", postgresql_where=sa.text("decided_at IS NULL")
    )
    op.drop_table("canary")
