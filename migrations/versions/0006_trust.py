"""Trust: training attempts per transition; idempotency keys per episode.

- `transition.train_attempts` counts the claims that did not end in training; at the trainer's
  `--max-train-attempts` the transition is set aside (skip_reason `train_failed`) so that one bad
  batch cannot stall training. NOT NULL DEFAULT 0 is metadata-only in Postgres >= 11: no rewrite.
- A reward's idempotency key is unique per episode, not globally: the same key in another
  episode is another reward (it was silently dropped as a duplicate).
- `api_key`: tenants' keys, as hashes (core/tenants.py).
- A step reward whose transition is not stored yet (recorded by another proxy replica, still in
  its writer queue) is kept pending (`pending_transition_id` / `pending_tool_call_id`) and
  joined to its transition when that is written, as final rewards for unknown episodes are.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

PENDING = "pending_transition_id IS NOT NULL OR pending_tool_call_id IS NOT NULL"


def upgrade() -> None:
    op.add_column(
        "transition",
        sa.Column("train_attempts", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column("reward", sa.Column("pending_transition_id", sa.Uuid(), nullable=True))
    op.add_column("reward", sa.Column("pending_tool_call_id", sa.Text(), nullable=True))
    op.create_index(
        "ix_reward_pending",
        "reward",
        ["episode_id"],
        postgresql_where=sa.text(PENDING),
    )
    op.create_table(
        "api_key",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("key_hash", sa.LargeBinary(), nullable=False),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_key")),
    )
    op.drop_constraint("uq_reward_idempotency_key", "reward", type_="unique")
    op.create_unique_constraint("uq_reward_episode_id", "reward", ["episode_id", "idempotency_key"])


def downgrade() -> None:
    op.drop_constraint("uq_reward_episode_id", "reward", type_="unique")
    op.drop_table("api_key")
    op.create_unique_constraint("uq_reward_idempotency_key", "reward", ["idempotency_key"])
    op.drop_index("ix_reward_pending", table_name="reward")
    op.drop_column("reward", "pending_tool_call_id")
    op.drop_column("reward", "pending_transition_id")
    op.drop_column("transition", "train_attempts")
