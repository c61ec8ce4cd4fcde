"""Benchmarks: each compares against its anchor in the same run and reports the ratio."""
