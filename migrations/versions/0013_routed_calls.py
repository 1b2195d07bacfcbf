"""Calls routed to providers through litellm (issue 15, part 4): `transition.provider` (which one
answered; NULL: vLLM) and `transition.cost_usd` (litellm's price of the call).

Adding a nullable column without a default rewrites nothing, on every partition at once.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("transition", sa.Column("provider", sa.Text(), nullable=True))
    op.add_column("transition", sa.Column("cost_usd", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("transition", "cost_usd")
    op.drop_column("transition", "provider")
