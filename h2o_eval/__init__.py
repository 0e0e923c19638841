"""h2o_eval: measure what KV-cache eviction costs in accuracy.

The API is imported on first use, so that ``python -m h2o_eval`` can answer a skipped run without loading
transformers.
"""

from importlib import import_module
from typing import Any

_API = {
    "ConfigError": "h2o_eval.errors",
    "EvictionCache": "h2o_eval.cache",
    "compress": "h2o_eval.generation",
    "patch": "h2o_eval.backend",
    "load_model": "h2o_eval.models",
    "make_policy": "h2o_eval.policies",
}
__all__ = list(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'h2o_eval' has no attribute {name!r}")
    return getattr(import_module(_API[name]), name)
