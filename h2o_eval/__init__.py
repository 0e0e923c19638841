"""h2o_eval: measure what KV-cache eviction costs in accuracy."""

from h2o_eval.errors import ConfigError
from h2o_eval.models import load_model

__all__ = ["ConfigError", "load_model"]
