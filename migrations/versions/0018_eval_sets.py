"""`eval_set` (issue 42): prompts with references that each new version of a lineage is asked
before it serves (trainer/evals.py), for the promotion gate.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "eval_set",
        sa.Column("id", sa.Integer(), sa.Identity(always=False), nullable=False),
        sa.Column("lineage", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("scorer", sa.Text(), nullable=False),
        sa.Column("items", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_eval_set")),
        sa.UniqueConstraint("lineage", "name", name=op.f("uq_eval_set_lineage")),
    )


def downgrade() -> None:
    op.drop_table("eval_set")
