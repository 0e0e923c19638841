from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.policies.base import Plan, Policy, Rule, check_number


@dataclass(frozen=True)
class KNorm(Policy):
    """Key norm (Devoto et al. 2024, arXiv:2406.11430; kvpress's ``KnormPress``): keep the keys with the smallest
    L2 norm. Needs no attention; compresses the prompt, then keeps every later token (prefill and context
    protocols only). As the authors and kvpress, nothing is protected by default.

    Args:
        recent_ratio: share of C kept as a window of the most recent tokens, C - floor(C * (1 - recent_ratio))
            (0: none, as the authors and kvpress).
    """

    recent_ratio: float = 0.0
    name: ClassVar[str] = "knorm"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "recent_ratio", self.recent_ratio, low=0, high=1)

    @property
    def rule(self) -> Rule:
        return Rule(grows=True)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=capacity - math.floor(capacity * (1 - self.recent_ratio) + 1e-9))

    def key_scores(self, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor:
        return -key.float().norm(dim=-1)
