"""Agent frameworks and client libraries driving the proxy (against the fake vLLM)."""
