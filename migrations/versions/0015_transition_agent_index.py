"""An index on `transition (agent_name, episode_id)` (issue 33): the dashboard's episode list
filtered by an agent with no calls, or few long ago, read every episode (or every call) to find
none; with it, the agent's episodes are an index probe (proxy/record/store/dashboard.py).

On the partitioned table: each partition gets its own, as the other indexes of migration 0011.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_transition_agent_name", "transition", ["agent_name", "episode_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_transition_agent_name", table_name="transition")
