"""Benchmark scripts: ``python -m h2o_eval.benchmarks.<name> --help`` (a module named ``_...`` is a part of one)."""
