from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import Plan, PromptScorer, check_number
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.leverage import sketched_leverage
from h2o_eval.policies.non_causal_attention import non_causal_scores


@dataclass(frozen=True)
class Compactor(PromptScorer):
    """Compactor (Chari & Van Durme 2025, arXiv:2507.08143; kvpress's ``CompactorPress``): keep the tokens that
    are outliers of the key geometry or that their chunk attends to.

    The first ``sink_size_start`` and the last ``sink_size_end`` prompt tokens are kept. The tokens between them
    score blending x their z-normalised leverage (``leverage``'s score on those tokens) + their z-normalised
    non-causal chunked attention (``non_causal_attention``'s score on those tokens, chunks starting after the
    sinks). Prefill and context protocols only. ``adakv`` over this policy is kvpress's ``adakv_compactor``
    (``AdaKVPress(CompactorPress())``): kvpress's max score on the kept ends puts them in each head's safeguard
    share, as the protected tokens count in it here.

    As kvpress (whose default blending is its compression ratio, 1 - budget), with the leverage sketch's seed and
    the padded batches of ``leverage``; an integer budget blends by 1 - C / T of each prompt of T tokens. Where C
    is smaller than the kept ends, the first tokens and then the newest are kept (kvpress: ``torch.topk``'s order
    among their equal scores).

    Args:
        sink_size_start: first tokens always kept.
        sink_size_end: last prompt tokens always kept.
        chunk_size: the tokens that attend to each other in the non-causal attention.
        sketch_dimension: columns of the leverage scores' Gaussian sketch.
        blending: the leverage scores' weight; None: the compression ratio.
        seed: seeds the sketch.
    """

    sink_size_start: int = 8
    sink_size_end: int = 4
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: float | None = None
    seed: int = 42
    name: ClassVar[str] = "compactor"
    example: ClassVar[dict[str, Any]] = {
        "sink_size_start": 2,
        "sink_size_end": 2,
        "chunk_size": 8,
        "sketch_dimension": 8,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("sink_size_start", "sink_size_end", "seed"):
            check_number(self.name, name, getattr(self, name), integer=True, low=0)
        check_number(self.name, "chunk_size", self.chunk_size, integer=True, low=1)
        check_number(self.name, "sketch_dimension", self.sketch_dimension, integer=True, low=1)
        if self.blending is not None:
            check_number(self.name, "blending", self.blending, low=0)

    def ends(self, length: int) -> tuple[int, int]:
        """The first and last tokens of a ``length``-token prompt that are kept whatever their score."""
        start = min(self.sink_size_start, length)
        return start, min(self.sink_size_end, length - start)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        start, end = self.ends(length)
        sinks = min(start, capacity)
        return Plan(capacity=capacity, recent=min(end, capacity - sinks), sinks=sinks)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        leverage, attention = prompt.once(
            f"compactor {self.sink_size_start} {self.sink_size_end} {self.chunk_size} {self.sketch_dimension} "
            f"{self.seed}",
            lambda: self._parts(prompt),
        )
        found = torch.zeros_like(scores)
        for row in range(scores.shape[0]):
            length = int(prompt.real[row].sum())
            middle = self.middle(prompt, row)
            if middle.numel() > 0:
                blending = self.blending if self.blending is not None else self.ratio(length)
                blended = blending * leverage[row][:, middle] + attention[row][:, middle]
                found[row] = blended.max()
                found[row][:, middle] = blended
        return found

    def middle(self, prompt: Prompt, row: int) -> torch.Tensor:
        """The columns of one sequence's prompt between the kept ends."""
        real = prompt.real[row].nonzero().flatten()
        start, end = self.ends(real.numel())
        return real[start : real.numel() - end]

    def _parts(self, prompt: Prompt) -> torch.Tensor:
        """[2, B, Hkv, n] the z-normalised leverage and non-causal attention scores of the tokens between the kept
        ends, each computed on those tokens alone (0 elsewhere)."""
        parts = prompt.key.new_zeros((2, *prompt.key.shape[:-1]), dtype=torch.float32)
        for row in range(prompt.key.shape[0]):
            middle = self.middle(prompt, row)
            if middle.numel() > 0:
                query, key, value = (x[row][:, middle] for x in (prompt.query, prompt.key, prompt.value))
                parts[0, row][:, middle] = sketched_leverage(prompt, middle, row, self.sketch_dimension, self.seed)
                parts[1, row][:, middle] = non_causal_scores(query, key, value, self.chunk_size)
        return parts

    def ratio(self, length: int) -> float:
        """kvpress's compression ratio for a ``length``-token prompt: 1 - budget, or 1 - C / length."""
        if isinstance(self.budget, float):
            return 1 - self.budget
        return 1 - min(self.capacity(length), length) / length
