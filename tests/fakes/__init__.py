"""fakes/: the fake vLLM held to the real one's wire format."""
