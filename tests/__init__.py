"""Flywheel tests: real Postgres, real clients, fake or real vLLM (see conftest.py)."""
