"""proxy/relay/: a call to vLLM and back."""
