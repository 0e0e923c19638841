from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Heads, Plan, Policy, Rule, check_number


@dataclass(frozen=True)
class AdaKV(Policy):
    """Ada-KV (Feng et al. 2024, arXiv:2407.11550): a scoring policy whose KV heads share their layer's slots.

    When the prompt is compressed, each layer's Hkv * C slots go to the best scores of all its KV heads
    together; each head is guaranteed its protected tokens and its floor(alpha * C) best (the safeguard), as
    kvpress's AdaKVPress does. Heads then hold different numbers of tokens. Everything else (scores, layout,
    what happens after the prompt) is the ``base`` policy's, which may be any policy whose scores rank tokens
    per KV head (:meth:`refusal`). Prefill and context protocols only.

    Args:
        base: the scoring policy (a :class:`Policy`; ``make_policy("adakv", base="snapkv", window=16)`` builds
            it from its name and parameters).
        alpha: the safeguard share of C guaranteed to each head.
    """

    base: Policy | None = None
    alpha: float = 0.2
    name: ClassVar[str] = "adakv"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")
    example: ClassVar[dict[str, Any]] = {"window": 4}

    def __post_init__(self) -> None:
        if self.base is None:
            from h2o_eval.policies.snapkv import SnapKV

            object.__setattr__(self, "base", SnapKV(budget=self.budget))
        if (reason := self.refusal(self.base)) is not None:
            raise ConfigError(f"adakv: base={self.base.name!r} {reason}")
        object.__setattr__(self, "budget", self.base.budget)
        super().__post_init__()
        check_number(self.name, "alpha", self.alpha, low=0, high=1)

    @staticmethod
    def refusal(base: Policy) -> str | None:
        """Why ``base`` cannot share its layer's slots by score (None: it can). It needs scores that rank the
        unprotected tokens of each KV head, and a cache."""
        if not base.has_cache:
            return "computes its own attention and holds no cache: use a scoring policy such as snapkv"
        if not base.ranks_tokens:
            return "ranks no tokens by score (recency alone decides): use a scoring policy such as snapkv"
        if base.rule.heads == Heads.LAYER:
            return (
                "with heads=layer keeps one token set per layer, which per-head shares cannot change: add heads=kv "
                "(+policy.heads=kv on the command line)"
            )
        if isinstance(base, AdaKV):
            return "already shares its layer's slots: use its base"
        return None

    @property
    def rule(self) -> Rule:
        return dataclasses.replace(self.base.rule, safeguard=self.alpha)

    def capacity(self, length: int) -> int:
        return self.base.capacity(length)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return self.base.plan(length, layer, num_layers)

    def key_scores(self, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor | None:
        return self.base.key_scores(key, position, layer)
