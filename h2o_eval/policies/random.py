from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.policies.base import Rule, check_number
from h2o_eval.policies.h2o import H2O


def random_scores(seed: int, layer: int, position: torch.Tensor) -> torch.Tensor:
    """A uniform [0, 1) score per (seed, layer, KV head, position): the same on every path and step."""
    heads = torch.arange(position.shape[1], device=position.device).view(1, -1, 1)
    x = (position * 1_000_003 + heads * 7_919 + layer * 104_729 + seed * 15_485_863) & 0x7FFFFFFF
    for _ in range(3):  # a few rounds of an integer hash (xorshift-multiply), all in int64
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
        x = ((x ^ (x >> 12)) * 0x297A2D39) & 0x7FFFFFFF
    return (x & 0xFFFFFF).to(torch.float32) / float(1 << 24)


@dataclass(frozen=True)
class Random(H2O):
    """H2O's layout with a seeded random score in place of accumulated attention (a control)."""

    seed: int = 0
    name: ClassVar[str] = "random"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "seed", self.seed, integer=True)

    @property
    def rule(self) -> Rule:
        return Rule()

    def position_scores(self, position: torch.Tensor, layer: int) -> torch.Tensor:
        return random_scores(self.seed, layer, position)
