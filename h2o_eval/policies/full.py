from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from h2o_eval.policies.base import UNBOUNDED, Policy


@dataclass(frozen=True)
class Full(Policy):
    """No eviction: the capacity is unbounded, so the cache holds the whole sequence whatever the budget."""

    budget: float | int = 1.0
    name: ClassVar[str] = "full"

    def capacity(self, length: int) -> int:
        return UNBOUNDED
