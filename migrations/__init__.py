"""Alembic migrations for Flywheel's tables (see proxy/tables.py). Applied by `flywheel migrate`."""
