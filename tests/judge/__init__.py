"""judge/: the LLM judge."""
