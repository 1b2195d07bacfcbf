"""Automatic intermediate rewards: transition.tool_errors and reward.source.

`tool_errors` holds what the proxy found wrong with a transition's tool calls (proxy/air.py);
`source` says who gave a reward ("air" for the proxy's own, or what a client posted). Both are
nullable without a default: adding them rewrites no row, however large the tables are.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("transition", sa.Column("tool_errors", JSONB(), nullable=True))
    op.add_column("reward", sa.Column("source", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("reward", "source")
    op.drop_column("transition", "tool_errors")
