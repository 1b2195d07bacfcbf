"""The benchmarks' short runs: each script run as a process, its report read."""
