from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import Plan, Policy, Rule, check_flag, check_number
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.sequences import each_sequence


def window_attention(query: torch.Tensor, key: torch.Tensor, normalize: bool) -> torch.Tensor:
    """[Hq, m - w] the attention the last w of m tokens' queries [Hq, w, D] give the m - w tokens before them, over
    keys [Hq, m, D] (logits over sqrt(D), causal within the window, softmax in float32), each query's row times its
    token index when ``normalize`` (FINCH's normalisation by the row's count of visible keys, as kvpress writes it),
    averaged over the queries (kvpress's ``FinchPress.score``)."""
    window, length = query.shape[1], key.shape[1]
    logits = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(key.shape[-1])
    future = torch.ones(window, length, dtype=torch.bool, device=key.device).triu(length - window + 1)
    weights = torch.softmax(logits.masked_fill(future, -torch.inf), dim=-1, dtype=torch.float32).to(query.dtype)
    weights = weights[..., : length - window]
    if normalize:
        weights = weights * torch.arange(length - window, length, device=key.device).view(1, -1, 1)
    return weights.mean(dim=-2)


@dataclass(frozen=True)
class Finch(Policy):
    """FINCH (Corallo & Papotti 2024, TACL, doi:10.1162/tacl_a_00716; kvpress's ``FinchPress``): the prompt's last
    ``window`` queries choose the tokens to keep, each query's attention weighted by its position.

    A token before the window scores the attention the window's queries give it (their causal softmax), each
    query's row multiplied by its token index (``normalize_scores``), averaged over the window and over the KV
    head's query heads; no pooling. The window is kept with the best of the rest. Prefill and context protocols
    only (under ``prefill`` the question is the prompt's end, as in kvpress's query-aware runs FINCH needs).

    What differs from kvpress, and why: kvpress's window is the question, found by a delimiter token between
    context and question that its model and tokenizer are extended with; a prompt here carries no boundary between
    its context and its question, so the window is a fixed number of the prompt's last tokens (``window``: equal
    to kvpress where it is the question's length). As kvpress by default, the kept keys are re-rotated to contiguous
    positions (``rerotate_keys``, :mod:`h2o_eval.rerotation`: they end at the prompt's last token, where kvpress puts
    them at 0..C-1 and continues the question from C, the same distances); ``rerotate_keys=False`` keeps every key
    as its token's rotary embedding made it, kvpress's ``FinchPress(rerotate_keys=False)``. Re-rotated, the prompt
    is fed alone, so not on log-likelihood tasks. kvpress's optional chunked selection (``chunk_length``, off by
    default) is not offered. Beyond kvpress, a padded batch scores each sequence's real tokens.

    Args:
        window: the prompt's last tokens whose queries vote (and that are kept).
        normalize_scores: weight each query's attention by its token index.
        rerotate_keys: re-rotate the kept keys to contiguous positions after the compression.
    """

    window: int = 64
    normalize_scores: bool = True
    rerotate_keys: bool = True
    name: ClassVar[str] = "finch"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")
    example: ClassVar[dict[str, Any]] = {"window": 4}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "window", self.window, integer=True, low=1)
        check_flag(self.name, "normalize_scores", self.normalize_scores)
        check_flag(self.name, "rerotate_keys", self.rerotate_keys)

    @property
    def rerotates(self) -> bool:
        return self.rerotate_keys

    @property
    def rule(self) -> Rule:
        return Rule(grows=True)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=min(self.window, capacity))

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        kv_heads, group = prompt.key.shape[1], prompt.group

        def score(row: int, real: torch.Tensor) -> torch.Tensor:
            found = prompt.key.new_zeros(kv_heads, real.numel(), dtype=torch.float32)
            if real.numel() > self.window:  # else the window is the whole prompt
                query = prompt.query[row][:, real[-self.window :]]
                key = prompt.key[row][:, real].repeat_interleave(group, dim=0)
                voted = window_attention(query, key, self.normalize_scores)
                found[:, : -self.window] = voted.view(kv_heads, group, -1).mean(dim=1)
            return found

        return each_sequence(prompt, score)
