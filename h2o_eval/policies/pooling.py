"""Scores pooled along positions, as a compressed prompt's are (``Rule.pooling``): what the mechanism's compression
and a policy that selects by its base's pooled scores (ChunkKV) both read."""

from __future__ import annotations

import torch

from h2o_eval.policies.base import Pooling, Rule


def pool_scores(scores: torch.Tensor, domain: torch.Tensor, rule: Rule) -> torch.Tensor:
    """The scores with those in ``domain`` [B, Hkv, N] pooled along positions, as torch's ``max_pool1d`` /
    ``avg_pool1d`` (stride 1, padding kernel_size // 2, avg counting the padding) would pool each (sequence, KV
    head)'s domain scores laid out in slot order, which on a prompt is position order."""
    if rule.pooling is None or not bool(domain.any()):
        return scores
    batch, kv_heads, _ = scores.shape
    length = int(domain.sum(-1).max())
    index = torch.where(domain, domain.cumsum(-1) - 1, length)  # rank in the domain; elsewhere a spare column
    fill = float("-inf") if rule.pooling == Pooling.MAX else 0.0  # what torch pads with
    dense = torch.full((batch, kv_heads, length + 1), fill, dtype=torch.float32, device=scores.device)
    dense = dense.scatter(-1, index, scores.float())[..., :length]
    dense = torch.where(torch.arange(length, device=scores.device) < domain.sum(-1, keepdim=True), dense, fill)
    pool = torch.nn.functional.max_pool1d if rule.pooling == Pooling.MAX else torch.nn.functional.avg_pool1d
    pooled = pool(dense.reshape(batch * kv_heads, 1, length), rule.kernel_size, stride=1, padding=rule.kernel_size // 2)
    pooled = pooled.view(batch, kv_heads, length).gather(-1, index.clamp(max=length - 1))
    return torch.where(domain, pooled, scores)
