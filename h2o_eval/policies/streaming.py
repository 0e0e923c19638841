from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Plan, Policy, check_number


@dataclass(frozen=True)
class Streaming(Policy):
    """StreamingLLM (Xiao et al. 2023, arXiv:2309.17453): the first ``sinks`` tokens plus the most recent ones.

    Args:
        sinks: attention-sink tokens kept from the start; with a fraction budget at most C - 1 of them are
            kept (the current token needs a slot).
    """

    sinks: int = 4
    name: ClassVar[str] = "streaming"
    example: ClassVar[dict[str, Any]] = {"sinks": 2}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "sinks", self.sinks, integer=True, low=0)
        if isinstance(self.budget, int) and self.sinks >= self.budget:
            raise ConfigError(
                f"streaming: sinks={self.sinks} leaves no slot for recent tokens in a budget of {self.budget} "
                f"tokens: use sinks <= {self.budget - 1} or a larger budget"
            )

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        sinks = min(self.sinks, capacity - 1)
        return Plan(capacity=capacity, recent=capacity - sinks, sinks=sinks)
