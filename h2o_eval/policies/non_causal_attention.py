from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import PromptScorer, check_number
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.leverage import z_normalize
from h2o_eval.policies.sequences import each_sequence


def chunked_column_sums(query: torch.Tensor, key: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[H, m] the attention each of m tokens receives within its chunk of ``chunk_size`` tokens, every query of the
    chunk attending to every key of it (no causal mask, no logit scale), summed over the queries; ``query``, ``key``
    [H, m, D]. As kvpress's ``NonCausalAttnPress.non_causal_chunked_attn``, the last chunk is completed with zero
    queries and keys: they take part in its softmaxes (the zero queries attend uniformly and add to its columns)."""
    heads, length, dim = key.shape
    padded = math.ceil(length / chunk_size) * chunk_size
    fill = query.new_zeros(heads, padded - length, dim)
    query = torch.cat([query, fill], dim=1).view(heads, -1, chunk_size, dim)
    key = torch.cat([key, fill], dim=1).view(heads, -1, chunk_size, dim)
    dots = torch.matmul(query, key.transpose(-2, -1))
    outside = torch.arange(padded - chunk_size, padded, device=key.device) >= length
    dots[:, -1].masked_fill_(outside.view(1, -1, 1), 0)
    dots[:, -1].masked_fill_(outside.view(1, 1, -1), -1e-9)
    return torch.softmax(dots.to(torch.float32), dim=-1).sum(dim=-2).view(heads, padded)[:, :length]


def non_causal_scores(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[Hkv, m] kvpress's ``NonCausalAttnPress`` scores of one sequence: the chunked column sums
    (:func:`chunked_column_sums`) of the queries [Hq, m, D] on the keys [Hkv, m, D], averaged over each KV head's
    query heads, times the value norms, average-pooled along positions (kernel 3, zero padding counted), then
    z-normalised over the KV heads and tokens."""
    group = query.shape[0] // key.shape[0]
    sums = chunked_column_sums(query, key.repeat_interleave(group, dim=0), chunk_size)
    scores = sums.view(key.shape[0], group, -1).mean(dim=1) * value.norm(dim=-1)
    pooled = torch.nn.functional.avg_pool1d(scores.unsqueeze(0), kernel_size=3, padding=1, stride=1)[0]
    return z_normalize(pooled)


@dataclass(frozen=True)
class NonCausalAttention(PromptScorer):
    """Non-causal chunked attention (Chari & Van Durme 2025, arXiv:2507.08143; kvpress's ``NonCausalAttnPress``):
    keep the tokens the prompt's queries of their chunk attend to most, looking both ways.

    The prompt is cut into chunks of ``chunk_size`` tokens; within a chunk every query attends to every key (no
    causal mask). A token's score is the attention it receives there, summed over the chunk's queries, averaged
    over the KV head's query heads, times its value's norm, average-pooled along positions (kernel 3) and
    z-normalised over the layer's KV heads and tokens. Nothing is protected. Prefill and context protocols only.

    As kvpress: the logits are not scaled by 1 / sqrt(D), and the last chunk is completed with zero queries and
    keys that take part in its softmaxes. Beyond kvpress, a padded batch scores each sequence's real tokens, its
    chunks starting at its first token.

    Args:
        chunk_size: the tokens that attend to each other.
    """

    chunk_size: int = 256
    name: ClassVar[str] = "non_causal_attention"
    example: ClassVar[dict[str, Any]] = {"chunk_size": 8}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "chunk_size", self.chunk_size, integer=True, low=1)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        return prompt.once(f"non_causal_attention {self.chunk_size}", lambda: self._scores(prompt))

    def _scores(self, prompt: Prompt) -> torch.Tensor:
        def score(row: int, real: torch.Tensor) -> torch.Tensor:
            query, key, value = (x[row][:, real] for x in (prompt.query, prompt.key, prompt.value))
            return non_causal_scores(query, key, value, self.chunk_size)

        return each_sequence(prompt, score)
