"""h2o_eval: measure what KV-cache eviction costs in accuracy."""

from h2o_eval.backend import EvictionCache, patch
from h2o_eval.errors import ConfigError
from h2o_eval.models import load_model
from h2o_eval.policies import make_policy

__all__ = ["ConfigError", "EvictionCache", "load_model", "make_policy", "patch"]
