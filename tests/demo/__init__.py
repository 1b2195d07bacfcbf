"""demo/: the demo tasks, their agents and models."""
