"""Which implementation of the mechanism a cache runs, chosen once from ``kernels`` and the device: the chunk
function (the definition's loop, or the fast path on its PyTorch and numba kernels or on the Triton kernels) and the
decode attention that scores while it attends (the PyTorch reference or the flash-decoding kernel). Every kernel a
cache runs is chosen here."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h2o_eval.chunks import Kernels, attend_chunk, scan_triton
from h2o_eval.eviction import attend_chunk_reference
from h2o_eval.kernels.prompt import prompt_votes
from h2o_eval.kernels.reference import decode_attention_reference
from h2o_eval.policies import Rule, check_kernels
from h2o_eval.policies.base import DecodeVote, Heads


@dataclass(frozen=True)
class Implementation:
    """``chunk(query, key, value, chunk) -> Result``: a chunk through the mechanism. ``decode_attention(rule)``: the
    decode step's kernel for ``rule``, bound once (a decode layout binds it when it is made), ``(query [B, Hq, D],
    keys, values, held, scores, scaling) -> output [B, Hq, D]``: one query per sequence over the held slots, the
    rule's votes folded into ``scores`` in place."""

    chunk: Callable
    decode_attention: Callable[[Rule], Callable[..., torch.Tensor]]


def _bound_reference_decode(rule: Rule) -> Callable[..., torch.Tensor]:
    replace, layer = rule.decode_votes == DecodeVote.REPLACE, rule.heads == Heads.LAYER
    return functools.partial(decode_attention_reference, replace=replace, layer=layer)


def _bound_triton_decode(rule: Rule) -> Callable[..., torch.Tensor]:
    """The flash-decoding kernel itself where it adds its votes per KV head, else :func:`_triton_decode`."""
    from h2o_eval.kernels.decode_attention import decode_attention

    if rule.decode_votes == DecodeVote.ADD and rule.heads == Heads.KV:
        return decode_attention
    return functools.partial(_triton_decode, rule=rule)


def _triton_decode(query, keys, values, held, scores, scaling, rule: Rule) -> torch.Tensor:
    """The flash-decoding kernel for a rule other than votes added per KV head: its votes in a zeroed buffer first."""
    from h2o_eval.kernels.decode_attention import decode_attention

    votes = torch.zeros_like(scores)
    output = decode_attention(query, keys, values, held, votes, scaling)
    if rule.heads == Heads.LAYER:
        votes = votes.sum(1, keepdim=True)
    if rule.decode_votes == DecodeVote.ADD:
        scores.add_(votes)
    else:
        torch.where(held, votes, scores, out=scores)
    return output


def choose(kernels: str, device: torch.device) -> Implementation:
    """``auto``: the Triton kernels on CUDA, the fast CPU path elsewhere; ``torch``: the definition's loop and the
    PyTorch decode attention; ``triton``: the Triton kernels (CUDA, or Triton's interpreter in tests)."""
    check_kernels(kernels, device.type)
    triton = kernels == "triton" or (kernels == "auto" and device.type == "cuda")
    if kernels == "torch":
        return Implementation(attend_chunk_reference, _bound_reference_decode)
    if triton:
        chunk_kernels = Kernels(votes=functools.partial(prompt_votes, triton=True), scan=scan_triton)
        return Implementation(functools.partial(attend_chunk, kernels=chunk_kernels), _bound_triton_decode)
    return Implementation(attend_chunk, _bound_reference_decode)
