"""flywheel/: the console script."""
