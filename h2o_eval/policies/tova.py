from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from h2o_eval.policies.base import Plan, Policy, Rule


@dataclass(frozen=True)
class TOVA(Policy):
    """TOVA (Oren et al. 2024, arXiv:2401.06104): evict the token the latest query attended to least."""

    name: ClassVar[str] = "tova"

    @property
    def rule(self) -> Rule:
        return Rule(votes="all", combine="replace")

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=1)
