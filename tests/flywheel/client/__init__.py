"""flywheel/client/: the applications' client."""
