"""trainer/data/: the torch-free side: batches and advantages."""
