from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import Plan, Policy, Rule, Votes, check_number
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.pooling import pool_scores
from h2o_eval.policies.wrapper import Wrapper


def press_scores(base: Policy, prompt: Prompt, scores: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, n] a base policy's scores of a prompt as kvpress's press of the same method scores it, given the
    mechanism's unpooled scores (votes or key scores): pooled over the tokens the base does not protect, rescored
    by the base's own scorer, window votes averaged (kvpress's SnapKV means them) and the base's protected tokens
    (its recent window and sinks for a prompt of that length) scored the largest other score + 1, as kvpress's
    SnapKV pads its window. Padding columns score 0."""
    real = prompt.real
    lengths = real.sum(-1)
    plans = [base.plan(int(length)) for length in lengths.tolist()]
    recent = torch.tensor([plan.recent for plan in plans], device=real.device).view(-1, 1)
    sinks = torch.tensor([plan.sinks for plan in plans], device=real.device).view(-1, 1)
    index = real.cumsum(-1) - 1  # each column's token index among its sequence's real tokens
    window = real & (index >= lengths.view(-1, 1) - recent)
    protected = (window | (real & (index < sinks))).unsqueeze(1).expand_as(scores)
    older = (real & ~window).unsqueeze(1).expand_as(scores)
    pooled = pool_scores(scores, older, base.rule)
    found = base.compression_scores(prompt, pooled, protected) if base.rescores else None
    if found is None:
        found = pooled / (base.rule.window * prompt.group) if base.rule.votes == Votes.WINDOW else pooled
    found = found.float().masked_fill(~real.unsqueeze(1), 0.0)
    top = found.masked_fill(protected | ~real.unsqueeze(1), -torch.inf).amax(dim=(1, 2), keepdim=True)
    return torch.where(protected, top + 1, found)


def chunk_scores(token_scores: torch.Tensor, chunk_length: int) -> torch.Tensor:
    """[c] the mean score of each chunk of ``chunk_length`` consecutive tokens (the last may be shorter) of
    ``token_scores`` [m] (kvpress's ``ChunkKVPress``)."""
    complete = token_scores.numel() // chunk_length
    means = token_scores[: complete * chunk_length].view(complete, chunk_length).mean(dim=-1)
    if token_scores.numel() % chunk_length:
        means = torch.cat([means, token_scores[complete * chunk_length :].mean(dim=-1, keepdim=True)])
    return means


@dataclass(frozen=True)
class ChunkKV(Wrapper):
    """ChunkKV (Liu et al. 2025, arXiv:2502.00299; kvpress's ``ChunkKVPress``): a base policy's scores choose whole
    chunks of consecutive tokens.

    The prompt is cut into chunks of ``chunk_length`` tokens from its first token (the last may be shorter). A
    chunk's score is the mean over its tokens of the base's scores summed over the KV heads, the scores being those
    kvpress's press of the base would give (:func:`press_scores`); the best int(c * budget) of the c chunks are kept
    whole (``rounding=up``: ceil; an integer budget B: ceil(B / chunk_length) chunks), in every KV head alike, and
    nothing else is protected. Where the base protects the prompt's last tokens (SnapKV's window), the last, shorter
    chunk is always among them, as kvpress's press of the base scores it highest; C is the kept chunks' tokens. A
    prompt shorter than one chunk is compressed by the base's own scores. Prefill and context protocols only; the
    default base is ``snapkv`` with kvpress's settings (window 64, kernel 5, avg pooling), kvpress's leaderboard
    ``chunkkv``.

    As kvpress (which asks its base for ``ScorerPress.score``), except: chunks tied at the cut keep the newest
    (kvpress: ``torch.topk``'s order, which may differ from layer to layer and then leave layers of different
    lengths that its ``DynamicCache`` cannot decode); with a base that does not protect the prompt's end, C counts
    full chunks, so where the shorter last chunk wins anyway its spare slots go to the best other chunk's newest
    tokens (C cannot depend on the scores); kvpress gives a base's protected tokens its own top scores (SnapKV: the
    largest + 1, as here; others their own values); each sequence of a padded batch chooses its own chunks (kvpress:
    the first sequence's for all).

    Args:
        base: the scoring policy (any policy that ranks tokens; not a wrapper).
        chunk_length: the tokens of a chunk.
    """

    chunk_length: int = 20
    name: ClassVar[str] = "chunkkv"
    default_base_name: ClassVar[str] = "snapkv"
    default_base_params: ClassVar[dict[str, Any]] = {"window": 64, "kernel_size": 5, "pooling": "avg"}
    example: ClassVar[dict[str, Any]] = {"chunk_length": 4, "window": 4, "kernel_size": 3}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "chunk_length", self.chunk_length, integer=True, low=1)

    @classmethod
    def refusal(cls, base: Policy) -> str | None:
        if isinstance(base, Wrapper):
            return f"is a wrapper: {cls.name} chooses by a scoring policy's own scores (kvpress's ScorerPress)"
        return super().refusal(base)

    @property
    def rule(self) -> Rule:
        return dataclasses.replace(self.base.rule, pooling=None, kernel_size=1, grows=True)

    @property
    def rescores(self) -> bool:
        return True

    def chunks_kept(self, chunks: int) -> int:
        """How many of ``chunks`` chunks are kept."""
        if isinstance(self.budget, float):
            return self.base.capacity(chunks)
        return min(chunks, math.ceil(self.budget / self.chunk_length))

    def capacity(self, length: int) -> int:
        """The kept chunks' tokens (the base's C for a prompt shorter than a chunk)."""
        if length < self.chunk_length:
            return self.base.capacity(length)
        capacity = self.chunks_kept(math.ceil(length / self.chunk_length)) * self.chunk_length
        if self.keeps_last(length):
            capacity -= self.chunk_length - length % self.chunk_length
        return capacity

    def keeps_last(self, length: int) -> bool:
        """Whether a ``length``-token prompt ends with a shorter chunk that is always kept: its tokens are among
        those the base protects (SnapKV's window), so kvpress's press of the base scores them highest."""
        rest = length % self.chunk_length
        return rest > 0 and self.base.plan(length).recent >= rest

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        if length < self.chunk_length:
            return self.base.plan(length, layer, num_layers)
        return Plan(capacity=self.capacity(length), recent=0)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        found = press_scores(self.base, prompt, scores)
        for row in range(found.shape[0]):
            real = prompt.real[row].nonzero().flatten()
            if real.numel() >= self.chunk_length:
                means = chunk_scores(found[row][:, real].sum(dim=0), self.chunk_length)
                chosen = self.chosen(means, real.numel())
                means = torch.where(chosen, means + (means.max() - means.min() + 1), means)  # chosen chunks first
                found[row][:, real] = means.repeat_interleave(self.chunk_length)[: real.numel()]
        return found

    def chosen(self, means: torch.Tensor, length: int) -> torch.Tensor:
        """[c] bool: the chunks a ``length``-token prompt keeps, by their mean scores ``means`` [c]: the best
        int(c * budget) (ties: the newest), the shorter last chunk among them where C counts it."""
        count, last = self.chunks_kept(means.numel()), self.keeps_last(length)
        ranked = means[:-1] if last else means
        order = ranked.numel() - 1 - torch.argsort(ranked.flip(0), descending=True, stable=True)
        chosen = torch.zeros_like(means, dtype=torch.bool)
        chosen[order[: count - last]] = True
        chosen[-1] |= last
        return chosen
