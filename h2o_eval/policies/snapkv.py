from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Plan, Policy, Pooling, Rule, check_number


@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV (Li et al. 2024, arXiv:2404.14469): the prompt's last ``window`` queries vote for the keys to keep.

    At the end of the prompt (Tc tokens), each position j < Tc - window is scored by the attention the last
    ``window`` prompt queries give it (their full causal softmax), summed over those queries and over the KV
    head's query heads, then pooled along positions; the top C - window positions are kept with the last
    ``window`` prompt tokens (C <= window keeps the last C). Prompt rows attend in full; every later token is
    kept. Prefill and context protocols only.

    Where this differs from the authors' code: they repeat K/V per query head and select per query head, so a
    GQA model caches Hq selections; here a KV head keeps one selection, voted by all its query heads.

    Args:
        window: the observation window, the prompt's last queries (and tokens always kept).
        kernel_size: the pooling window along positions (odd).
        pooling: ``"max"`` (the paper's) or ``"avg"``, as torch's max_pool1d / avg_pool1d with stride 1 and
            padding kernel_size // 2 (avg counts the padding, as torch does by default).
    """

    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    name: ClassVar[str] = "snapkv"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")
    example: ClassVar[dict[str, Any]] = {"window": 4}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "window", self.window, integer=True, low=1)
        check_number(self.name, "kernel_size", self.kernel_size, integer=True, low=1)
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"{self.name}: kernel_size={self.kernel_size}: use an odd size such as 7")
        if self.pooling not in tuple(Pooling):
            valid = ", ".join(p.value for p in Pooling)
            raise ConfigError(f"{self.name}: pooling={self.pooling!r}: use one of {valid}")

    @property
    def rule(self) -> Rule:
        return Rule(votes="window", window=self.window, pooling=self.pooling, kernel_size=self.kernel_size, grows=True)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=min(self.window, capacity))
