from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from h2o_eval.policies.base import Plan, check_number
from h2o_eval.policies.snapkv import SnapKV


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024, arXiv:2406.02069): SnapKV's selection with capacities falling linearly with
    depth, more in lower layers, their mean over layers equal to C.

    Beyond the ``window``, layer 0 keeps ``high`` and the last layer ``low`` = floor((C - window) / beta),
    ``high`` = 2 (C - window) - low, as in the authors' code (where the prompt is too short for ``high``,
    high = Tc - window and low = 2 (C - window) - high, as there too). The authors step by an integer
    (high - low) // (L - 1), so their mean falls short of C; here the linear values are rounded so that the
    layers sum to exactly L (C - window) (largest remainders, lower layers first on ties).

    Args:
        beta: (C - window) / low, the steepness of the pyramid (20 in the paper's code).
    """

    beta: float = 20
    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "beta", self.beta, low=1)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        window = min(self.window, capacity)
        if num_layers == 1 or capacity <= window or capacity >= length:
            return Plan(capacity=capacity, recent=window)
        return Plan(capacity=window + self.layer_budgets(length, num_layers)[layer], recent=window)

    def layer_budgets(self, length: int, num_layers: int) -> list[int]:
        """Tokens beyond the window kept by each layer, summing to num_layers * (C - window)."""
        budget = self.capacity(length) - min(self.window, self.capacity(length))
        low = math.floor(budget / self.beta)
        high = 2 * budget - low
        if high >= length - self.window:
            high = length - self.window
            low = 2 * budget - high
        exact = [high - (high - low) * layer / (num_layers - 1) for layer in range(num_layers)]
        counts = [math.floor(x + 1e-9) for x in exact]
        order = sorted(range(num_layers), key=lambda i: (-(exact[i] - counts[i]), i))
        for i in order[: num_layers * budget - sum(counts)]:
            counts[i] += 1
        return counts
