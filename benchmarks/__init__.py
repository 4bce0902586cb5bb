"""Benchmarks of tq-warmup (``python -m benchmarks.tqbench``); not part of the package."""
