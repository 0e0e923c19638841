from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.policies.base import Plan, Policy, Rule
from h2o_eval.policies.inputs import Prompt


@dataclass(frozen=True)
class ObservedAttention(Policy):
    """Observed attention (kvpress's ``ObservedAttentionPress``, after H2O, Zhang et al. 2023, arXiv:2306.14048):
    keep the prompt tokens with the largest average attention.

    A token's score is the attention the prompt's queries gave it (their full causal softmax), summed over the rows
    and divided by the number of rows that could see it (the prompt's length minus its index), averaged over the
    KV head's query heads. Nothing is protected; the prompt is compressed once and every later token is kept
    (prefill and context protocols only).

    How it differs from ``h2o``: H2O sums the attention a token received (so the first tokens, seen by every row,
    gain the most), keeps a recent window of C - floor(C * heavy_ratio) tokens, and evicts one token per arriving
    token after the prompt; this policy averages over the rows that saw each token, protects nothing and never
    evicts after the prompt.

    As kvpress, which reads the eager attention weights; beyond kvpress, a padded batch counts each sequence's real
    rows.
    """

    name: ClassVar[str] = "observed_attention"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")

    @property
    def rule(self) -> Rule:
        return Rule(votes="all", grows=True)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=0)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        rows = prompt.real.flip(-1).cumsum(-1).flip(-1)  # [B, n] the real prompt rows at or after each column
        return scores / rows.clamp(min=1).unsqueeze(1) / prompt.group
