"""Benchmarks: scripts that print figures and append them to bench/results.md (see issue 5)."""
