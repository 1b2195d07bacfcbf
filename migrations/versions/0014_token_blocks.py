"""Prompts' token ids in content-addressed blocks (issue 16): `token_block`, and
`transition.prompt_blocks` naming a prompt's whole blocks in order (its rest stays in
`prompt_token_ids`). Existing rows keep their whole prompt in `prompt_token_ids` (blocks NULL),
which every reader takes as it is (core/tables.py PROMPT_IDS_SQL).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "token_block",
        sa.Column("digest", sa.LargeBinary(), nullable=False),
        sa.Column("ids", sa.LargeBinary(), nullable=False),
        sa.Column("last_used", sa.Date(), server_default=sa.text("CURRENT_DATE"), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_token_block")),
    )
    op.add_column(
        "transition",
        sa.Column("prompt_blocks", postgresql.ARRAY(sa.LargeBinary()), nullable=True),
    )


def downgrade() -> None:
    # Whole prompts back into their rows first: nothing recorded is lost going down.
    op.execute(
        "UPDATE transition t SET prompt_blocks = NULL, prompt_token_ids = ("
        "SELECT string_agg(b.ids, ''::bytea ORDER BY d.ord) "
        "FROM unnest(t.prompt_blocks) WITH ORDINALITY AS d(digest, ord) "
        "JOIN token_block b ON b.digest = d.digest) || coalesce(t.prompt_token_ids, ''::bytea) "
        "WHERE t.prompt_blocks IS NOT NULL"
    )
    op.drop_column("transition", "prompt_blocks")
    op.drop_table("token_block")
