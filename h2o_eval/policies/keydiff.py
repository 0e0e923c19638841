from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.policies.base import PromptScorer
from h2o_eval.policies.inputs import Prompt


@dataclass(frozen=True)
class KeyDiff(PromptScorer):
    """KeyDiff (Park et al. 2025, arXiv:2504.15364; kvpress's ``KeyDiffPress``): keep the keys least like the
    average key. A key's score is minus its cosine similarity to the mean of the prompt's unit-norm keys (per KV
    head); nothing is protected. Prefill and context protocols only.

    As kvpress: one selection over the whole prompt (the paper's block-wise iteration is kvpress's ``BlockPress``
    around it, not this policy); beyond kvpress, the mean runs over each sequence's real tokens of a padded batch.
    """

    name: ClassVar[str] = "keydiff"
    scores_held: ClassVar[bool] = True

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        keys = prompt.key.float()
        real = prompt.real.unsqueeze(1).unsqueeze(-1).float()  # [B, 1, n, 1]
        unit = torch.nn.functional.normalize(keys, p=2, dim=-1)
        anchor = (unit * real).sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True).clamp(min=1)
        return -torch.nn.functional.cosine_similarity(keys, anchor, dim=-1)
