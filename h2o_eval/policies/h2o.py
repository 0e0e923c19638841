from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from h2o_eval.policies.base import Plan, Policy, Rule, check_number


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048): accumulated attention plus the most recent
    tokens, one token evicted per token once the cache is full.

    Args:
        heavy_ratio: share of the capacity for heavy hitters, floor(C * heavy_ratio); the rest, at least
            the current token, is the recent window.
    """

    heavy_ratio: float = 0.5
    name: ClassVar[str] = "h2o"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "heavy_ratio", self.heavy_ratio, low=0, high=1)

    @property
    def rule(self) -> Rule:
        return Rule(votes="all")

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        heavy = math.floor(capacity * self.heavy_ratio + 1e-9)
        return Plan(capacity=capacity, recent=max(1, capacity - heavy))


@dataclass(frozen=True)
class Heavy(Policy):
    """Heavy hitters only (H2O's accumulated attention), plus the current token."""

    name: ClassVar[str] = "heavy"

    @property
    def rule(self) -> Rule:
        return Rule(votes="all")

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=1)
