"""Migration scripts, one per schema change, in order."""
