"""Flywheel proxy: an OpenAI-compatible gateway in front of vLLM that records transitions."""
