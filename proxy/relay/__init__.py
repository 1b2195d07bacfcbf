"""The relay wing: everything a completion call passes on its way to vLLM (or a provider) and back.

It reaches the record wing only through its door, proxy/record/intake.py (a contract in
pyproject.toml); docs/architecture.md draws both wings.
"""
