"""core/: what the proxy and the trainer both stand on."""
