"""Tables and migrations stay in step; every migration can be undone."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from core.database import alembic_config, migrate, sqlalchemy_url
from core.partitions import is_partition
from core.tables import Base


def test_autogenerate_finds_no_difference(database_url: str) -> None:
    engine = create_engine(sqlalchemy_url(database_url))
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_name": _not_partition})
        diff = compare_metadata(context, Base.metadata)
    engine.dispose()
    assert diff == []


def _not_partition(name: str | None, type_: str, _: object) -> bool:
    return not (type_ == "table" and is_partition(name or ""))


def test_downgrade_to_nothing_and_back(database_url: str) -> None:
    config = alembic_config(database_url)
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


def test_0007_puts_existing_adapters_and_the_trainer_queue_in_their_lineage(
    database_url: str,
) -> None:
    """The versions of before lineages are `policy`'s; so are the rows a trainer may still claim
    (else no trainer would ever train them)."""
    config = alembic_config(database_url)
    command.downgrade(config, "0006")
    engine = create_engine(sqlalchemy_url(database_url))
    row = (
        "INSERT INTO transition (id, episode_id, request_id, choice_index, requested_at, route, "
        "status, http_status, policy_version, message_digests, params, latency_ms, trained_at) "
        "VALUES (gen_random_uuid(), 'm7', gen_random_uuid(), 0, now(), 'chat', 'ok', 200, {}, "
        "'{{}}', '{{}}', 1, {})"
    )
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO adapter_version (version, name, path, base_model, is_current) "
            "VALUES (1, 'policy-v1', '/a', 'demo', false), (2, 'policy-v2', '/a', 'demo', true)"
        )
        conn.exec_driver_sql("INSERT INTO episode (id) VALUES ('m7')")
        conn.exec_driver_sql(row.format(2, "NULL"))  # waiting for the trainer
        conn.exec_driver_sql(row.format(1, "now()"))  # trained: history, left as it is
        conn.exec_driver_sql(row.format("NULL", "NULL"))  # not the policy
    migrate(database_url)
    with engine.begin() as conn:
        adapters = conn.exec_driver_sql(
            "SELECT name, lineage, is_current FROM adapter_version ORDER BY 1"
        ).all()
        lineages = conn.exec_driver_sql(
            "SELECT policy_version, lineage FROM transition ORDER BY policy_version NULLS LAST"
        ).all()
    engine.dispose()
    assert adapters == [("policy-v1", "policy", False), ("policy-v2", "policy", True)]
    assert lineages == [(1, None), (2, "policy"), (None, None)]
