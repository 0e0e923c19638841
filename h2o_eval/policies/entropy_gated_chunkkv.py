from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Plan, check_number
from h2o_eval.policies.chunkkv import ChunkKV, press_scores
from h2o_eval.policies.inputs import Prompt

EPSILON = 1e-8  # kvpress's, in the entropies


def normalised_entropy(scores: torch.Tensor) -> torch.Tensor:
    """[...] the entropy of each row of ``scores`` [..., k] as a distribution (shifted up to 0 where negative),
    divided by log k and clamped to [0, 1] (kvpress's ``EntropyGatedChunkKVPress``)."""
    shifted = scores - scores.amin(dim=-1, keepdim=True).clamp(max=0.0)
    share = shifted / (shifted.sum(dim=-1, keepdim=True) + EPSILON)
    entropy = -(share * (share + EPSILON).log()).sum(dim=-1)
    return (entropy / math.log(scores.shape[-1])).clamp(0.0, 1.0)


def gated_selection(scores: torch.Tensor, chunk_length: int, spiky_keep: int, budget: int) -> torch.Tensor:
    """[m] bool: the ``budget`` tokens of ``scores`` [m] that kvpress's ``EntropyGatedChunkKVPress`` keeps. Chunks
    go in decreasing mean score; a chunk of at least the median score and below the median entropy keeps only its
    best ``spiky_keep`` tokens, any other chunk is kept whole; the last chunk taken is cut to the budget (its best
    tokens), and a budget left over goes to the best tokens not yet kept."""
    length = scores.numel()
    complete, rest = divmod(length, chunk_length)
    means = scores[: complete * chunk_length].view(complete, chunk_length).mean(dim=1)
    entropy = normalised_entropy(scores[: complete * chunk_length].view(complete, chunk_length))
    if rest:
        tail = scores[complete * chunk_length :]
        means = torch.cat([means, tail.mean().unsqueeze(0)])
        tail_entropy = normalised_entropy(tail) if rest > 1 else torch.zeros((), device=scores.device)
        entropy = torch.cat([entropy, tail_entropy.view(1)])
    spiky = ((means >= means.median()) & (entropy < entropy.median())).tolist()
    keep = torch.zeros(length, dtype=torch.bool, device=scores.device)
    for chunk in torch.argsort(means, descending=True).tolist():
        if budget <= 0:
            break
        start, end = chunk * chunk_length, min((chunk + 1) * chunk_length, length)
        kept = min(end - start, budget, spiky_keep if spiky[chunk] else length)
        if kept == end - start:
            keep[start:end] = True
        else:
            keep[torch.topk(scores[start:end], kept).indices + start] = True
        budget -= kept
    leftover = (~keep).nonzero().flatten()
    if budget > 0 and leftover.numel() > 0:
        keep[leftover[torch.topk(scores[leftover], min(budget, leftover.numel())).indices]] = True
    return keep


@dataclass(frozen=True)
class EntropyGatedChunkKV(ChunkKV):
    """Entropy-gated ChunkKV (kvpress's ``EntropyGatedChunkKVPress``, after ChunkKV, Liu et al. 2025,
    arXiv:2502.00299): ChunkKV's chunks, where an important chunk whose scores are spiky keeps only its best tokens.

    The base's scores (as kvpress's press of the base gives them, summed over the KV heads) are cut into chunks of
    ``chunk_length`` tokens. Chunks are taken in decreasing mean score until C tokens are kept: a chunk of at least
    the median mean score whose normalised score entropy is below the median keeps only its best
    ``low_entropy_chunk_length`` tokens, any other is kept whole, the last one taken is cut to C, and what is left
    of C goes to the best tokens not yet kept (:func:`gated_selection`). Every KV head keeps the same C tokens and
    nothing else is protected. Prefill and context protocols only; the default base is ``snapkv`` with kvpress's
    settings.

    As kvpress, with ``chunkkv``'s differences for the base's scores and padded batches; kvpress orders chunks and
    tokens of equal scores by ``torch.argsort`` / ``torch.topk``, as here, so ties may differ only where the
    scores differ in their last bits.

    Args:
        base: the scoring policy (any policy that ranks tokens; not a wrapper).
        chunk_length: the tokens of a chunk.
        low_entropy_chunk_length: the tokens a spiky chunk keeps (fewer than ``chunk_length``).
    """

    chunk_length: int = 10
    low_entropy_chunk_length: int = 4
    name: ClassVar[str] = "entropy_gated_chunkkv"
    example: ClassVar[dict[str, Any]] = {"chunk_length": 4, "low_entropy_chunk_length": 2, "window": 4}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "low_entropy_chunk_length", self.low_entropy_chunk_length, integer=True, low=1)
        if self.low_entropy_chunk_length >= self.chunk_length:
            raise ConfigError(
                f"{self.name}: low_entropy_chunk_length={self.low_entropy_chunk_length}: use fewer than "
                f"chunk_length={self.chunk_length}"
            )

    def capacity(self, length: int) -> int:
        return self.base.capacity(length)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=0)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        found = press_scores(self.base, prompt, scores)
        for row in range(found.shape[0]):
            real = prompt.real[row].nonzero().flatten()
            if real.numel() > 0:
                budget = min(int(prompt.capacity[row].min()), real.numel())
                kept = gated_selection(found[row][:, real].sum(dim=0), self.chunk_length, self.low_entropy_chunk_length,
                                       budget)  # fmt: skip
                found[row][:, real] = kept.float()
        return found
