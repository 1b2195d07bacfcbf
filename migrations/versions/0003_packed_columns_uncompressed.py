"""Packed token ids and logprobs: stored out of line without compression (STORAGE EXTERNAL).

pglz tried to compress every prompt's packed token ids, failed to save anything (int32/float32
of sampled tokens are close to incompressible), and was about a third of Postgres's CPU per
recorded transition. Only rows written from now on are affected; nothing is rewritten.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = ("prompt_token_ids", "completion_token_ids", "logprobs")  # tables.UNCOMPRESSED


def upgrade() -> None:
    op.execute(
        "ALTER TABLE transition " + ", ".join(f"ALTER {c} SET STORAGE EXTERNAL" for c in COLUMNS)
    )


def downgrade() -> None:
    op.execute(
        "ALTER TABLE transition " + ", ".join(f"ALTER {c} SET STORAGE EXTENDED" for c in COLUMNS)
    )
