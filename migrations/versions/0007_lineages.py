"""Lineages: one adapter lineage per agent role (issue 12).

- `adapter_version.lineage`: which lineage a version belongs to (its name is `<lineage>-vN`);
  each lineage has its own current version, so the one-current index becomes one per lineage.
  Existing versions take the lineage their name says (`policy-v7` -> `policy`).
- `transition.lineage`: the lineage whose policy served the call (the proxy resolves `policy`
  per agent, proxy/alias.py); NULL: not the policy. Only the untrained rows a trainer may still
  claim are filled in here (with `policy`, the only lineage there was): a trained history of
  any size is left as it is, and the episode view names its adapter by `model_used`.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "adapter_version",
        sa.Column("lineage", sa.Text(), server_default=sa.text("'policy'"), nullable=False),
    )
    op.execute(
        "UPDATE adapter_version SET lineage = regexp_replace(name, '-v[0-9]+$', '') "
        "WHERE name ~ '-v[0-9]+$'"
    )
    op.drop_index(
        "uq_adapter_version_current",
        table_name="adapter_version",
        postgresql_where=sa.text("is_current"),
    )
    op.create_index(
        "uq_adapter_version_current",
        "adapter_version",
        ["lineage"],
        unique=True,
        postgresql_where=sa.text("is_current"),
    )
    op.add_column("transition", sa.Column("lineage", sa.Text(), nullable=True))
    op.execute(
        "UPDATE transition SET lineage = 'policy' "
        "WHERE policy_version IS NOT NULL AND trained_at IS NULL"
    )


def downgrade() -> None:
    op.drop_column("transition", "lineage")
    op.drop_index(
        "uq_adapter_version_current",
        table_name="adapter_version",
        postgresql_where=sa.text("is_current"),
    )
    op.create_index(
        "uq_adapter_version_current",
        "adapter_version",
        ["is_current"],
        unique=True,
        postgresql_where=sa.text("is_current"),
    )
    op.drop_column("adapter_version", "lineage")
