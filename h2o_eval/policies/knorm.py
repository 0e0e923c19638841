from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.policies.base import Rule
from h2o_eval.policies.h2o import H2O


@dataclass(frozen=True)
class KNorm(H2O):
    """Key norm (Devoto et al. 2024, arXiv:2406.11430): keep the keys with the smallest L2 norm, plus the recent
    window of H2O's layout. Needs no attention; compresses the prompt, then keeps every later token."""

    name: ClassVar[str] = "knorm"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")

    @property
    def rule(self) -> Rule:
        return Rule(grows=True)

    def key_scores(self, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor:
        return -key.float().norm(dim=-1)
