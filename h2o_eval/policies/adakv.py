from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Plan, Policy, Rule, check_number

# Scoring policies Ada-KV can share a layer's slots for: those whose scores rank unprotected tokens.
BASES = ("snapkv", "pyramidkv", "knorm", "h2o", "heavy", "tova")


@dataclass(frozen=True)
class AdaKV(Policy):
    """Ada-KV (Feng et al. 2024, arXiv:2407.11550): a scoring policy whose KV heads share their layer's slots.

    When the prompt is compressed, each layer's Hkv * C slots go to the best scores of all its KV heads
    together; each head is guaranteed its protected tokens and its floor(alpha * C) best (the safeguard), as
    kvpress's AdaKVPress does. Heads then hold different numbers of tokens. Everything else (scores, layout,
    what happens after the prompt) is the ``base`` policy's. Prefill and context protocols only.

    Args:
        base: the scoring policy (a :class:`Policy`; ``make_policy("adakv", base="snapkv", window=16)`` builds
            it from its name and parameters).
        alpha: the safeguard share of C guaranteed to each head.
    """

    base: Policy | None = None
    alpha: float = 0.2
    name: ClassVar[str] = "adakv"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")

    def __post_init__(self) -> None:
        if self.base is None:
            from h2o_eval.policies.snapkv import SnapKV

            object.__setattr__(self, "base", SnapKV(budget=self.budget))
        if self.base.name not in BASES:
            raise ConfigError(f"adakv: base={self.base.name!r}: use one of {', '.join(BASES)}")
        if self.base.rule.heads == "layer":
            raise ConfigError(
                f"adakv: base={self.base.name!r} with heads=layer keeps one token set per layer, which per-head "
                "shares cannot change: add heads=kv (+policy.heads=kv on the command line)"
            )
        object.__setattr__(self, "budget", self.base.budget)
        super().__post_init__()
        check_number(self.name, "alpha", self.alpha, low=0, high=1)

    @property
    def rule(self) -> Rule:
        return dataclasses.replace(self.base.rule, safeguard=self.alpha)

    def capacity(self, length: int) -> int:
        return self.base.capacity(length)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return self.base.plan(length, layer, num_layers)

    def key_scores(self, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor | None:
        return self.base.key_scores(key, position, layer)
