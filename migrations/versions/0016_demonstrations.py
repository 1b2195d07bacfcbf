"""`demonstration` (issue 41): prompts with the answers they should get, posted by an application
or copied from a rewarded episode's calls, for the trainer's supervised steps
(trainer/learner/sft.py).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "demonstration",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("lineage", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=True),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("episode_id", sa.Text(), nullable=True),
        sa.Column("task_id", sa.Text(), nullable=True),
        sa.Column("agent_name", sa.Text(), nullable=True),
        sa.Column("transition_id", sa.Uuid(), nullable=True),
        sa.Column("messages", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("tools", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("completion", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("prompt_token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("completion_token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("epochs", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("trained_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("trained_version", sa.Integer(), nullable=True),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("claim_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("train_attempts", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("skip_reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_demonstration")),
        sa.UniqueConstraint("lineage", "idempotency_key", name=op.f("uq_demonstration_lineage")),
    )
    op.create_index(
        "ix_demonstration_queue", "demonstration", ["lineage", "epochs", "created_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_demonstration_queue", table_name="demonstration")
    op.drop_table("demonstration")
