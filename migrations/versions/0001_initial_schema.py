"""Initial schema: episode, message, transition, reward, adapter_version.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 10:28:14.426800
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapter_version",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("is_current", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_adapter_version")),
        sa.UniqueConstraint("name", name=op.f("uq_adapter_version_name")),
    )
    op.create_index(
        "uq_adapter_version_current",
        "adapter_version",
        ["is_current"],
        unique=True,
        postgresql_where=sa.text("is_current"),
    )
    op.create_table(
        "episode",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("task_id", sa.Text(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("final_reward", sa.Double(), nullable=True),
        sa.Column("final_reward_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_episode")),
    )
    op.create_table(
        "message",
        sa.Column("digest", sa.LargeBinary(), nullable=False),
        sa.Column("body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_message")),
    )
    op.create_table(
        "transition",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("episode_id", sa.Text(), nullable=False),
        sa.Column("request_id", sa.Uuid(), nullable=False),
        sa.Column("choice_index", sa.SmallInteger(), nullable=False),
        sa.Column("task_id", sa.Text(), nullable=True),
        sa.Column("agent_name", sa.Text(), nullable=True),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("route", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("http_status", sa.SmallInteger(), nullable=False),
        sa.Column("model_requested", sa.Text(), nullable=True),
        sa.Column("model_used", sa.Text(), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("message_digests", postgresql.ARRAY(sa.LargeBinary()), nullable=False),
        sa.Column("params", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("prompt_token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("completion_token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("logprobs", sa.LargeBinary(), nullable=True),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("tool_calls", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("finish_reason", sa.Text(), nullable=True),
        sa.Column("error", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("latency_ms", sa.Double(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("return", sa.Double(), nullable=True),
        sa.Column("credited_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("trained_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["episode_id"], ["episode.id"], name=op.f("fk_transition_episode_id_episode")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transition")),
    )
    op.create_index(
        "ix_transition_episode_id", "transition", ["episode_id", "requested_at"], unique=False
    )
    op.create_index(
        "ix_transition_trainable",
        "transition",
        ["credited_at"],
        unique=False,
        postgresql_where=sa.text(
            "status = 'ok' AND credited_at IS NOT NULL AND trained_at IS NULL"
        ),
    )
    op.create_table(
        "reward",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("episode_id", sa.Text(), nullable=False),
        sa.Column("transition_id", sa.Uuid(), nullable=True),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["episode_id"], ["episode.id"], name=op.f("fk_reward_episode_id_episode")
        ),
        sa.ForeignKeyConstraint(
            ["transition_id"], ["transition.id"], name=op.f("fk_reward_transition_id_transition")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reward")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_reward_idempotency_key")),
    )
    op.create_index(op.f("ix_reward_episode_id"), "reward", ["episode_id"], unique=False)
    op.create_index(op.f("ix_reward_transition_id"), "reward", ["transition_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_reward_transition_id"), table_name="reward")
    op.drop_index(op.f("ix_reward_episode_id"), table_name="reward")
    op.drop_table("reward")
    op.drop_index(
        "ix_transition_trainable",
        table_name="transition",
        postgresql_where=sa.text(
            "status = 'ok' AND credited_at IS NOT NULL AND trained_at IS NULL"
        ),
    )
    op.drop_index("ix_transition_episode_id", table_name="transition")
    op.drop_table("transition")
    op.drop_table("message")
    op.drop_table("episode")
    op.drop_index(
        "uq_adapter_version_current",
        table_name="adapter_version",
        postgresql_where=sa.text("is_current"),
    )
    op.drop_table("adapter_version")
