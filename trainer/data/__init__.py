"""The trainer's data wing, torch-free: what a step trains on, from Postgres to a batch.

`store` claims credited transitions and returns what a step did not take; `sampling` reads each
call's sampling settings back from its recorded parameters; `advantages` turns rewards into GRPO
advantages by task group; `batch` builds the step's batch from the claimed rows. None of it
imports torch (an import contract in pyproject.toml), so it is tested without a model.
"""
