"""Benchmarks: run one with `make bench-<name>`; not collected by pytest (no test_*.py)."""
