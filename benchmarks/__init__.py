"""Benchmarks (not part of the package): python -m benchmarks.llm_throughput --help."""
