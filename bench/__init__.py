"""Benchmarks, each runnable as ``python -m bench.<name>`` from the repository root."""
