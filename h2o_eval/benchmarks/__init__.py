"""Benchmark scripts: ``python -m h2o_eval.benchmarks.<name> --help``."""
