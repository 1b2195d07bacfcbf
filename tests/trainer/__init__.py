"""trainer/: the loop and its parts (the gate, candidates, evaluation, models)."""
