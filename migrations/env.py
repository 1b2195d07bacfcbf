"""Alembic environment: the URL comes from `core.database.migrate` (or `alembic -x url=...`)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from core.locks import Lock
from core.partitions import is_partition
from core.tables import Base

config = context.config
url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
if not url:
    raise SystemExit(
        "no database URL: run `flywheel migrate` or `alembic -x url=postgresql+psycopg://...`"
    )

engine = create_engine(url, poolclass=pool.NullPool)
with engine.connect() as connection:
    # One migrator at a time: several proxies may start together against one database.
    connection.exec_driver_sql(f"SELECT pg_advisory_lock({int(Lock.MIGRATE)})")
    connection.commit()  # the lock is the session's; Alembic opens its own transactions
    # One transaction per migration, so one may build an index CONCURRENTLY outside any (0008).
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        compare_type=True,
        transaction_per_migration=True,
        include_name=lambda name, type_, _: not (type_ == "table" and is_partition(name or "")),
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.exec_driver_sql(f"SELECT pg_advisory_unlock({int(Lock.MIGRATE)})")
    connection.commit()
engine.dispose()
