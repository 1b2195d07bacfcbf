"""Alembic migrations for Flywheel's tables (see core/tables.py). Applied by `flywheel migrate`."""
