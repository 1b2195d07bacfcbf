"""The Flywheel trainer: GRPO with LoRA on recorded transitions (see docs/architecture.md)."""
