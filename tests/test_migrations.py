"""Tables and migrations stay in step; every migration can be undone."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

import migrations
from core.database import migrate, sqlalchemy_url
from core.tables import Base


def test_autogenerate_finds_no_difference(database_url: str) -> None:
    engine = create_engine(sqlalchemy_url(database_url))
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_downgrade_to_nothing_and_back(database_url: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.attributes["url"] = sqlalchemy_url(database_url)
    command.downgrade(config, "base")
    engine = create_engine(sqlalchemy_url(database_url))
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    migrate(database_url)
    assert {"episode", "transition", "reward", "message", "adapter_version"} <= set(
        inspect(engine).get_table_names()
    )
    engine.dispose()


def test_partial_index_conditions_match(database_url: str) -> None:
    """Autogenerate does not compare `postgresql_where`: check those against the tables here."""
    engine = create_engine(sqlalchemy_url(database_url))
    with engine.connect() as conn:
        defs = dict(conn.exec_driver_sql("SELECT indexname, indexdef FROM pg_indexes").all())
    engine.dispose()
    for table in Base.metadata.tables.values():
        for index in table.indexes:
            where = index.dialect_options["postgresql"]["where"]
            if where is not None:
                for clause in str(where).split(" AND "):
                    column = clause.split()[0]
                    assert column in defs[index.name].split("WHERE", 1)[1], (index.name, clause)
