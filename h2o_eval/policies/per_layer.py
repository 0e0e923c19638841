from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Plan, Policy
from h2o_eval.policies.segments import layered
from h2o_eval.policies.wrapper import Wrapper


@dataclass(frozen=True)
class PerLayer(Wrapper):
    """kvpress's ``PerLayerCompressionPress``: a base policy with a budget of its own in every layer.

    Layer l is the base at ``budgets[l]`` (a fraction of the prompt, kvpress's 1 - compression_ratios[l], rounded as
    ``rounding`` says; ``rounding=down`` keeps kvpress's int(length * (1 - ratio))). The list has one budget per
    layer of the model (another length is refused when the model is known); the policy's ``budget`` is then their
    mean (kvpress's compression_ratio is the mean of its ratios) and the run's ``budget`` is not used. Without
    ``budgets`` every layer has the run's budget. The base is any policy with one capacity for all its layers that
    compresses each layer alone (not a wrapper, PyramidKV or KVzip). Unlike kvpress (flash attention only), any
    attention implementation runs it. Prefill and context only.

    Args:
        base: the policy each layer runs (default ``snapkv``).
        budgets: one fraction in (0, 1] per layer, or None.
    """

    budgets: tuple[float, ...] | None = None
    name: ClassVar[str] = "per_layer"
    default_base_name: ClassVar[str] = "snapkv"
    example: ClassVar[dict[str, Any]] = {"window": 4}

    def __post_init__(self) -> None:
        if self.budgets is not None:
            budgets = tuple(self.budgets) if isinstance(self.budgets, list | tuple) else ()
            if not budgets or not all(isinstance(b, float) and 0 < b <= 1 for b in budgets):
                raise ConfigError(
                    f"{self.name}: budgets={self.budgets!r}: use a list of fractions in (0, 1], one per layer, such "
                    "as [0.5, 0.25]"
                )
            object.__setattr__(self, "budgets", budgets)
        super().__post_init__()
        if self.budgets is not None:
            mean = sum(self.budgets) / len(self.budgets)
            object.__setattr__(self, "base", dataclasses.replace(self.base, budget=mean))
            object.__setattr__(self, "budget", mean)

    @classmethod
    def refusal(cls, base: Policy) -> str | None:
        if isinstance(base, Wrapper):
            return "is a wrapper: use a scoring policy (kvpress's ScorerPress)"
        if layered(base):
            return "gives its layers capacities of their own: use a policy with one capacity for all layers"
        if base.rehearses:
            return "scores by extra passes and may choose across layers: use a policy that compresses each layer alone"
        return super().refusal(base)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        if self.budgets is None:
            return self.base.plan(length, layer, num_layers)
        if len(self.budgets) != num_layers:
            raise ConfigError(
                f"{self.name}: budgets has {len(self.budgets)} entries and the model {num_layers} layers: give one "
                f"budget per layer ({num_layers})"
            )
        return dataclasses.replace(self.base, budget=self.budgets[layer]).plan(length, layer, num_layers)
