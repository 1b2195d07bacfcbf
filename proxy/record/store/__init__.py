"""All SQL of the proxy but the adapter lifecycle's (core/policy.py), one module per what it serves:

- `transitions.py`: recording, the background writer's batches;
- `rewards.py`: rewards as posted, step rewards waiting for their transition, AIR's, and credit;
- `episodes.py`: the episode row lock every transaction takes first, and an episode read back;
- `dashboard.py`: the dashboard's read-only aggregates and episode pages.

Functions take `*, session` and never commit: callers own transactions.
"""
