"""Retention (issue 15): `transition` partitioned by day on `requested_at`, and `message.last_used`.

Existing rows are not copied: the old table becomes one partition, `transition_legacy`, covering
everything before the start of the next UTC day (it needs one index build and one scan to check
that bound, no rewrite), and retention drops it whole once that day is old enough. A `DEFAULT`
partition takes rows no daily partition covers yet; `core/partitions.py` creates the daily ones
ahead and moves any rows the default partition holds into theirs.

A foreign key can reference a partitioned table only through a unique key that contains the
partition key, so `reward.transition_id` no longer has one: retention deletes a dropped
transition's step rewards itself (core/retention.py). `transition.episode_id` loses its foreign
key too: checking it probed every partition for each episode retention deleted (130 us each at
30 days) and cost a lookup per recorded row; the writer makes the episode in the transaction
that records its call, and retention deletes an episode only when `episode.last_call_at` (new
here, moved up by the writer under the episode's row lock) is older than its cutoff and no call
of it is left.

`message.last_used` (a day) lets retention prune messages without scanning transitions: the
writer sets it to at least the day of every transition that names the message (proxy/store.py).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

TRAINABLE = (
    "status = 'ok' AND credited_at IS NOT NULL AND trained_at IS NULL AND skip_reason IS NULL"
)
# (name, columns, where) of the parent's indexes; every partition gets its own of each.
INDEXES = (
    ("ix_transition_episode_id", "episode_id, requested_at", None),
    ("ix_transition_requested_at", "requested_at", None),
    ("ix_transition_policy_version", "policy_version, requested_at", None),
    ("ix_transition_trainable", "credited_at", TRAINABLE),
)


def upgrade() -> None:
    op.execute("ALTER TABLE reward DROP CONSTRAINT fk_reward_transition_id_transition")
    op.execute("ALTER TABLE transition DROP CONSTRAINT fk_transition_episode_id_episode")
    op.execute("ALTER TABLE episode ADD COLUMN last_call_at timestamptz")
    op.execute("ALTER TABLE transition RENAME TO transition_legacy")
    for name, _, _ in INDEXES:
        op.execute(
            f"ALTER INDEX {name} RENAME TO {name.replace('transition', 'transition_legacy')}"
        )
    op.execute(
        "ALTER TABLE transition_legacy RENAME CONSTRAINT pk_transition TO transition_legacy_id"
    )

    op.execute(
        "CREATE TABLE transition (LIKE transition_legacy INCLUDING DEFAULTS INCLUDING STORAGE) "
        "PARTITION BY RANGE (requested_at)"
    )
    op.execute("ALTER TABLE transition ADD CONSTRAINT pk_transition PRIMARY KEY (id, requested_at)")
    for name, columns, where in INDEXES:
        op.execute(
            f"CREATE INDEX {name} ON transition ({columns})" + (f" WHERE {where}" if where else "")
        )
    op.execute("CREATE TABLE transition_default PARTITION OF transition DEFAULT")

    bind = op.get_bind()
    if bind.exec_driver_sql("SELECT EXISTS (SELECT 1 FROM transition_legacy)").scalar():
        # Up to the start of the UTC day after both now and the newest row.
        bound = bind.exec_driver_sql(
            "SELECT date_trunc('day', greatest(now(), max(requested_at)) AT TIME ZONE 'UTC') "
            "+ interval '1 day' FROM transition_legacy"
        ).scalar()
        literal = f"'{bound.isoformat()}+00'"
        # The parent's key, made on the partition so that attaching it finds it (one build).
        op.execute("ALTER TABLE transition_legacy DROP CONSTRAINT transition_legacy_id")
        op.execute(
            "ALTER TABLE transition_legacy ADD CONSTRAINT transition_legacy_pkey "
            "PRIMARY KEY (id, requested_at)"
        )
        op.execute(
            "ALTER TABLE transition_legacy ADD CONSTRAINT transition_legacy_bound "
            f"CHECK (requested_at IS NOT NULL AND requested_at < {literal})"
        )
        op.execute(
            "ALTER TABLE transition ATTACH PARTITION transition_legacy "
            f"FOR VALUES FROM (MINVALUE) TO ({literal})"
        )
        op.execute("ALTER TABLE transition_legacy DROP CONSTRAINT transition_legacy_bound")
    else:
        op.execute("DROP TABLE transition_legacy")

    # current_date is stable, so this is a fast default: no rewrite of `message`.
    op.execute("ALTER TABLE message ADD COLUMN last_used date NOT NULL DEFAULT current_date")


def downgrade() -> None:
    op.execute("ALTER TABLE message DROP COLUMN last_used")
    op.execute("ALTER TABLE episode DROP COLUMN last_call_at")
    op.execute(
        "CREATE TABLE transition_flat (LIKE transition INCLUDING DEFAULTS INCLUDING STORAGE)"
    )
    op.execute("INSERT INTO transition_flat SELECT * FROM transition")
    op.execute("DROP TABLE transition")  # and every partition
    op.execute("ALTER TABLE transition_flat RENAME TO transition")
    op.execute("ALTER TABLE transition ADD CONSTRAINT pk_transition PRIMARY KEY (id)")
    op.execute(
        "ALTER TABLE transition ADD CONSTRAINT fk_transition_episode_id_episode "
        "FOREIGN KEY (episode_id) REFERENCES episode (id)"
    )
    for name, columns, where in INDEXES:
        op.execute(
            f"CREATE INDEX {name} ON transition ({columns})" + (f" WHERE {where}" if where else "")
        )
    op.execute(
        "ALTER TABLE reward ADD CONSTRAINT fk_reward_transition_id_transition "
        "FOREIGN KEY (transition_id) REFERENCES transition (id)"
    )
