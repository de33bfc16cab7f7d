"""Helpers the tests (and benchmarks) share: synthetic records, workers in subprocesses."""
