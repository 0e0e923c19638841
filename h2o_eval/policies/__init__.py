"""Eviction policies: small declarative settings over one mechanism (see ``h2o_eval.eviction``).

One file per policy: a frozen dataclass whose fields are its hyper-parameters, whose :class:`Rule` and
:class:`Plan` the mechanism reads. Adding a policy is its file, one entry in :data:`POLICIES`, its
``conf/policy/<name>.yaml`` and its tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from h2o_eval.errors import ConfigError
from h2o_eval.policies.adakv import AdaKV
from h2o_eval.policies.base import (
    DECODINGS,
    KERNELS,
    PROTOCOLS,
    ROUNDINGS,
    UNBOUNDED,
    Plan,
    Policy,
    Rule,
    check_decoding,
    check_kernels,
    check_protocol,
)
from h2o_eval.policies.chunkkv import ChunkKV
from h2o_eval.policies.compactor import Compactor
from h2o_eval.policies.criticalkv import CriticalKV
from h2o_eval.policies.cur import CUR
from h2o_eval.policies.entropy_gated_chunkkv import EntropyGatedChunkKV
from h2o_eval.policies.expected_attention import ExpectedAttention
from h2o_eval.policies.finch import Finch
from h2o_eval.policies.full import Full
from h2o_eval.policies.h2o import H2O, Heavy
from h2o_eval.policies.h2o_reference import H2OReference
from h2o_eval.policies.keydiff import KeyDiff
from h2o_eval.policies.knorm import KNorm
from h2o_eval.policies.kvzip import KVzip
from h2o_eval.policies.lagkv import LagKV
from h2o_eval.policies.leverage import Leverage
from h2o_eval.policies.local import Local
from h2o_eval.policies.non_causal_attention import NonCausalAttention
from h2o_eval.policies.observed_attention import ObservedAttention
from h2o_eval.policies.oracle import Oracle
from h2o_eval.policies.pyramidkv import PyramidKV
from h2o_eval.policies.random import Random
from h2o_eval.policies.snapkv import SnapKV
from h2o_eval.policies.streaming import Streaming
from h2o_eval.policies.tova import TOVA
from h2o_eval.policies.wrapper import Wrapper

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        Full,
        H2O,
        Local,
        Heavy,
        Streaming,
        TOVA,
        Random,
        H2OReference,
        SnapKV,
        PyramidKV,
        AdaKV,
        KNorm,
        ExpectedAttention,
        KeyDiff,
        CriticalKV,
        KVzip,
        Oracle,
        ObservedAttention,
        LagKV,
        CUR,
        NonCausalAttention,
        Leverage,
        Compactor,
        ChunkKV,
        EntropyGatedChunkKV,
        Finch,
    )  # fmt: skip
}

__all__ = [
    "DECODINGS",
    "KERNELS",
    "POLICIES",
    "PROTOCOLS",
    "ROUNDINGS",
    "UNBOUNDED",
    "Plan",
    "Policy",
    "Rule",
    "check_decoding",
    "check_kernels",
    "check_protocol",
    "configured_policy",
    "example_policy",
    "make_policy",
]


def _parameters(cls: type[Policy]) -> set[str]:
    return {f.name for f in fields(cls)} - {"budget", "rounding", "base"}


def make_policy(name: str, budget: float | int = 0.2, **params: Any) -> Policy:
    """The policy ``name`` with ``budget`` and its own parameters (``heavy_ratio``, ``sinks``, ``window`` ...);
    ``rounding`` (how a fraction budget becomes C) applies to every policy.

    A wrapper (``adakv``, ``criticalkv``) takes ``base`` (a policy name; each wrapper has a default) and its own
    parameters (``alpha``; ``epsilon``, ``first_stage_ratio``); its other parameters go to the base policy.
    """
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    if issubclass(cls, Wrapper):
        own = {key: params.pop(key) for key in _parameters(cls) if key in params}
        base = params.pop("base", None)
        if base is None:
            base, params = cls.default_base_name, cls.default_base_params | params
        if base not in POLICIES or issubclass(POLICIES[base], cls):
            valid = [n for n in POLICIES if not issubclass(POLICIES[n], cls) and cls.refusal(example_policy(n)) is None]
            raise ConfigError(f"{name}: base={base!r}: use one of {', '.join(valid)}")
        return cls(budget=budget, base=make_policy(base, budget, **params), **own)
    own = _parameters(cls)
    if unknown := set(params) - own - {"rounding"}:
        raise ConfigError(
            f"policy {name!r} takes no {', '.join(sorted(unknown))}: its parameters are "
            f"{', '.join(sorted(own)) or 'budget only'}"
        )
    if cls is Full:
        return Full(**{key: params[key] for key in ("rounding",) if key in params})
    return cls(budget=budget, **params)


def configured_policy(config: Mapping[str, Any]) -> Policy:
    """The policy a run's config names: its ``policy`` group (the name and the policy's own parameters) at its
    ``budget``, rounded as its ``rounding`` says."""
    params = {key: value for key, value in config["policy"].items() if key != "name"}
    return make_policy(config["policy"]["name"], budget=config["budget"], rounding=config["rounding"], **params)


def example_policy(name: str, budget: float | int = 0.5) -> Policy:
    """The registered policy ``name`` with its example parameters (what the generic test suites run)."""
    return make_policy(name, budget, **POLICIES[name].example)
