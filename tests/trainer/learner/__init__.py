"""trainer/learner/: the torch side: the engine, log-probabilities, SFT, ranks."""
