from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Plan, check_number
from h2o_eval.policies.snapkv import SnapKV

BUDGETS = ("authors", "kvpress")


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024, arXiv:2406.02069): SnapKV's selection with capacities falling linearly with
    depth, more in lower layers, their mean over layers equal to C.

    Beyond the ``window``, layer 0 keeps ``high`` and the last layer ``low`` = floor((C - window) / beta),
    ``high`` = 2 (C - window) - low, as in the authors' code (where the prompt is too short for ``high``,
    high = Tc - window and low = 2 (C - window) - high, as there too). The authors step by an integer
    (high - low) // (L - 1), so their mean falls short of C; here the linear values are rounded so that the
    layers sum to exactly L (C - window) (largest remainders, lower layers first on ties).

    ``budgets="kvpress"`` takes kvpress's formula instead (``PyramidKVPress.get_layer_budget``, 0.5.5): the pyramid
    spans all of C, the window inside it: layer 0 keeps ``high`` = 2 C - C / beta and the last layer C / beta (C
    unrounded, L (1 - ratio)), each layer ``round(high - layer (high - low) / (L - 1))``; where the prompt is too
    short for ``high``, high = Tc - window and low = 2 C - high, and where then not Tc >= high >= low >= window
    every layer keeps round(C), as SnapKV (at 4k tokens and beta 20: whenever C < 1280). ``rounding`` does not
    apply there.

    Args:
        beta: (C - window) / low, the steepness of the pyramid (20 in the paper's code).
        budgets: ``"authors"`` (the pyramid above the window) or ``"kvpress"`` (kvpress's).
    """

    beta: float = 20
    budgets: str = "authors"
    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "beta", self.beta, low=1)
        if self.budgets not in BUDGETS:
            raise ConfigError(f"{self.name}: budgets={self.budgets!r}: use one of {', '.join(BUDGETS)}")

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        if self.budgets == "kvpress":
            capacity = self.kvpress_capacity(length, layer, num_layers)
            return Plan(capacity=capacity, recent=min(self.window, capacity))
        capacity = self.capacity(length)
        window = min(self.window, capacity)
        if num_layers == 1 or capacity <= window or capacity >= length:
            return Plan(capacity=capacity, recent=window)
        return Plan(capacity=window + self.layer_budgets(length, num_layers)[layer], recent=window)

    def kvpress_capacity(self, length: int, layer: int, num_layers: int) -> int:
        """kvpress's kept count for ``layer``, computed as its ``get_layer_budget`` computes it (its floats)."""
        ratio = 1 - self.budget if isinstance(self.budget, float) else 1 - self.budget / length
        top = self.window + length * (1 - ratio)
        low = (top - self.window) / self.beta
        high = (top - self.window) * 2 - low
        if high >= length - self.window:
            high = length - self.window
            low = (top - self.window) * 2 - high
        if not (length >= high >= low >= self.window):
            return max(1, round(length * (1 - ratio)))
        steps = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
        return round(high - layer * steps)

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
