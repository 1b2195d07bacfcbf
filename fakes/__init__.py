"""What tests and benchmarks both stand on: the fake vLLM, a Postgres of one's own, the processes
under test, synthetic traffic. Below `bench/` and beside nothing the product imports."""
