"""The dashboard's indexes (issue 14): its pages read slices by time, not whole tables.

- `ix_episode_created_at` (created_at, id): the episode list, newest first, one keyset page at a
  time, and the reward over time.
- `ix_transition_requested_at` (requested_at): the overview's window (calls, versions, agents,
  tasks, skip reasons of the last hours).
Both built CONCURRENTLY: the proxies keep recording while they build on a large table.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

INDEXES = [
    ("ix_episode_created_at", "episode", ["created_at", "id"]),
    ("ix_transition_requested_at", "transition", ["requested_at"]),
]


def upgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, columns in INDEXES:
            op.create_index(name, table, columns, postgresql_concurrently=True, if_not_exists=True)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, _ in INDEXES:
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
