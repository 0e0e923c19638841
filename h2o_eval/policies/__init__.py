"""Eviction policies: small declarative settings over one mechanism (see ``h2o_eval.eviction``).

One file per policy: a frozen dataclass whose fields are its hyper-parameters, whose :class:`Rule` and
:class:`Plan` the mechanism reads. Adding a policy is its file (found here by its ``name``: :data:`POLICIES`), its
``conf/policy/<name>.yaml``, its tests and its row in docs/policies.md (the tests check both).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from h2o_eval.checks import ROUNDINGS
from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import (
    DECODINGS,
    KERNELS,
    PROTOCOLS,
    UNBOUNDED,
    Interval,
    Plan,
    Policy,
    Rule,
    check_decoding,
    check_kernels,
    check_protocol,
    refuse_interval_policy,
)
from h2o_eval.policies.full import Full
from h2o_eval.policies.wrapper import Wrapper

NOT_POLICIES = ("base", "inputs", "pooling", "sequences", "wrapper")  # the package's modules that define no policy


def _discovered() -> dict[str, type[Policy]]:
    """Every policy class this package defines, by name: each module's classes that name themselves (``name``), in
    the order of the modules' names and, within one, of their definitions. A policy is registered by its file."""
    found: dict[str, type[Policy]] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name in NOT_POLICIES:
            continue
        loaded = importlib.import_module(f"{__name__}.{module.name}")
        for value in vars(loaded).values():
            named = isinstance(value, type) and issubclass(value, Policy) and "name" in vars(value)
            if named and value.__module__ == loaded.__name__:
                found[value.name] = value
    return found


POLICIES: dict[str, type[Policy]] = _discovered()

__all__ = [
    "DECODINGS",
    "KERNELS",
    "POLICIES",
    "PROTOCOLS",
    "ROUNDINGS",
    "UNBOUNDED",
    "Interval",
    "Plan",
    "Policy",
    "Rule",
    "check_decoding",
    "check_kernels",
    "check_protocol",
    "configured_interval",
    "configured_policy",
    "example_policy",
    "make_policy",
]


def _parameters(cls: type[Policy]) -> set[str]:
    return {f.name for f in fields(cls) if f.init} - {"budget", "rounding", "base"}


def make_policy(name: str, budget: float | int = 0.2, threshold: float | None = None, **params: Any) -> Policy:
    """The policy ``name`` with ``budget`` and its own parameters (``heavy_ratio``, ``sinks``, ``window`` ...);
    ``rounding`` (how a fraction budget becomes C) applies to every policy. A ``threshold`` instead of a budget makes
    the policy the base of ``dms`` at that threshold (kvpress's DMSPress: tokens older than its window that score
    below it go), whatever the budget.

    A wrapper (``adakv``, ``criticalkv``) takes ``base`` (a policy name; each wrapper has a default) and its own
    parameters (``alpha``; ``epsilon``, ``first_stage_ratio``); its other parameters go to the base policy. The
    default base, named or not, starts from the wrapper's parameters for it (criticalkv's ``expected_attention``
    has ``use_vnorm=false``, kvpress's ``critical_expected_attention``); given ones override them.
    """
    if name not in POLICIES:
        raise ConfigError(f"policy={name}: no policy of that name: use one of {', '.join(sorted(POLICIES))}")
    if threshold is not None:
        if name == "dms" and "threshold" in params:
            raise ConfigError("threshold=... wraps the policy in dms, and policy=dms has its own: give one of them")
        if name != "dms":
            if isinstance(threshold, bool) or not isinstance(threshold, int | float):
                raise ConfigError(f"threshold={threshold!r}: use a number (tokens below it go), or null for a budget")
            if "base" in params:
                raise ConfigError(
                    f"threshold=... makes policy {name!r} the base of dms, and {name} wraps a base of its own: give a "
                    "policy that scores tokens itself, such as knorm or expected_attention"
                )
            return make_policy("dms", budget, base=name, threshold=threshold, **params)
        params["threshold"] = threshold
    cls = POLICIES[name]
    if issubclass(cls, Wrapper):
        own = {key: params.pop(key) for key in _parameters(cls) if key in params}
        base = params.pop("base", None) or cls.default_base_name
        if base == cls.default_base_name:  # named or not, the default base takes the wrapper's defaults for it
            params = cls.default_base_params | params
        if base not in POLICIES or issubclass(POLICIES[base], cls):
            valid = [n for n in POLICIES if not issubclass(POLICIES[n], cls) and cls.refusal(example_policy(n)) is None]
            raise ConfigError(f"{name}: base={base!r}: use one of {', '.join(valid)}")
        budget = cls.budget_of_base(budget)
        return cls(budget=budget, base=make_policy(base, budget, **params), **own)
    own = _parameters(cls)
    if unknown := set(params) - own - {"rounding"}:
        raise ConfigError(
            f"policy {name!r} takes no {', '.join(sorted(unknown))}: its parameters are "
            f"{', '.join(sorted(own)) or 'none of its own'}, with budget, rounding and threshold as every policy"
        )
    if cls is Full:
        return Full(**{key: params[key] for key in ("rounding",) if key in params})
    return cls(budget=budget, **params)


def configured_policy(config: Mapping[str, Any]) -> Policy:
    """The policy a run's config names: its ``policy`` group (the name and the policy's own parameters) at its
    ``budget``, rounded as its ``rounding`` says; with a ``threshold`` (not null), that policy as the base of
    ``dms`` at that threshold instead of a budget."""
    params = {key: value for key, value in config["policy"].items() if key != "name"}
    threshold = config.get("threshold")
    if "threshold" in params:  # policy=dms's own
        if threshold is not None:
            raise ConfigError("threshold=... wraps the policy in dms, and policy=dms has its own: give one of them")
        threshold = params.pop("threshold")
    return make_policy(config["policy"]["name"], config["budget"], threshold, rounding=config["rounding"], **params)


def configured_interval(config: Mapping[str, Any], policy: Policy) -> Interval | None:
    """``decoding=interval``'s settings a run's config names (its ``interval`` group: ``compression_interval``,
    ``target_size`` or ``target_ratio``, and ``policy``, the decoding policy as a name or a mapping of its name and
    parameters, null for the run's own ``policy``); None under another decoding."""
    if config.get("decoding") != "interval":
        return None
    group = dict(config.get("interval") or {})
    known = ("compression_interval", "target_size", "target_ratio", "policy")
    if unknown := set(group) - set(known):
        raise ConfigError(f"interval takes no {', '.join(sorted(unknown))}: its settings are {', '.join(known)}")
    spec = group.pop("policy", None)
    if spec is None:
        refuse_interval_policy(policy)
        return Interval(**group)
    spec = {"name": spec} if isinstance(spec, str) else spec
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ConfigError(f"interval.policy={spec!r}: use a policy name, or {{name: snapkv, window: 4}}")
    params = {key: value for key, value in spec.items() if key != "name"}
    return Interval(**group, policy=make_policy(spec["name"], 1.0, **params))


def example_policy(name: str, budget: float | int = 0.5) -> Policy:
    """The registered policy ``name`` with its example parameters (what the generic test suites run); an unknown name
    gets :func:`make_policy`'s error, which lists the known ones."""
    return make_policy(name, budget, **(POLICIES[name].example if name in POLICIES else {}))
