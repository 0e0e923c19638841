from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Heads, Plan, Policy, Rule


@dataclass(frozen=True)
class TOVA(Policy):
    """TOVA (Oren et al. 2024, arXiv:2401.06104): evict the token the latest query attended to least.

    As the authors' code does (``TOVACache.reduce``: the last row's attention averaged over every head of the
    layer, one top-k for all KV heads), the latest query's attention is summed over all the layer's query heads
    and the layer's KV heads keep one set of tokens (``heads="layer"``). ``heads="kv"`` ranks the tokens of each
    KV head by its own query heads' attention instead, so the heads keep different tokens.

    Where this differs from the authors' code: the current token is always kept (their top-k may drop it;
    kvpress's TOVAPress keeps it too).

    Args:
        heads: ``"layer"`` (the authors') or ``"kv"``.
    """

    heads: str = "layer"
    name: ClassVar[str] = "tova"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heads not in tuple(Heads):
            raise ConfigError(f"{self.name}: heads={self.heads!r}: use one of {', '.join(h.value for h in Heads)}")

    @property
    def rule(self) -> Rule:
        return Rule(votes="all", combine="replace", heads=self.heads)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=1)
