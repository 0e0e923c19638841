from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.policies.base import Plan
from h2o_eval.policies.h2o import H2O


@dataclass(frozen=True)
class H2OReference(H2O):
    """The H2O authors' lm-eval simulation, reproduced exactly (simulate protocol only).

    No cache is simulated: per query head, each row keeps a heavy set chosen from the accumulated *full*
    causal softmax of the earlier rows, OR-ed with a band of recent keys (:func:`reference_keep_mask`).
    Where it differs from ``h2o``: scores come from un-evicted attention rather than the attention a bounded
    cache really gives; the selection is per query head rather than per KV head; the budgets truncate
    (``int``) where ``h2o`` rounds C up; and the realised window is hb + rb + 1 keys.
    """

    name: ClassVar[str] = "h2o_reference"
    protocols: ClassVar[tuple[str, ...]] = ("simulate",)

    def budgets(self, length: int) -> tuple[int, int]:
        """(hb, rb) as the authors compute them: int(budget * heavy_ratio * T), int(budget * (1 - heavy_ratio) * T);
        an integer budget counts tokens instead of budget * T."""
        tokens = length * self.budget if isinstance(self.budget, float) else self.budget
        return int(tokens * self.heavy_ratio), int(tokens * (1 - self.heavy_ratio))

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        heavy, recent = self.budgets(length)
        capacity = min(heavy + recent + 1, max(length, 1))
        return Plan(capacity=capacity, recent=min(recent + 1, capacity))

    def attention(self, query, key, value, valid, scaling) -> torch.Tensor:
        """Output [B, Hq, T, D] of the authors' simulation for query [B, Hq, T, D], key/value [B, Hkv, T, D] and
        valid [B, T] (padding False), one sequence and query head at a time."""
        group = query.shape[1] // key.shape[1]
        keys = key.repeat_interleave(group, dim=1)
        values = value.repeat_interleave(group, dim=1)
        output = torch.zeros_like(query)
        for b in range(query.shape[0]):
            n = int(valid[b].sum())
            start = int((valid[b].cumsum(-1) == 0).sum())
            rows = slice(start, start + n)
            logits = torch.matmul(query[b, :, rows], keys[b, :, rows].transpose(-1, -2)) * scaling
            causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
            logits = logits.masked_fill(~causal, torch.finfo(logits.dtype).min)
            keep = reference_keep_mask(logits, *self.budgets(n))
            probs = torch.softmax(logits.masked_fill(~keep, torch.finfo(logits.dtype).min), dim=-1, dtype=torch.float32)
            output[b, :, rows] = torch.matmul(probs.to(values.dtype), values[b, :, rows])
        return output


def reference_keep_mask(logits: torch.Tensor, heavy_budget: int, recent_budget: int) -> torch.Tensor:
    """Which keys each query keeps in the authors' simulation (``local_heavy_hitter_mask`` + recent band).

    ``logits`` [H, T, T] already causal-masked with the dtype minimum. Rows < hb attend causally; each later
    row t keeps the top hb - 1 keys (``torch.topk``) by the accumulated *full* causal softmax of earlier rows,
    plus t; after row t's softmax is added, keys it did not keep get score 0 for good. The band t - rb .. t is
    OR-ed in, then everything is restricted to causal.
    """
    length = logits.shape[-1]
    keep = torch.zeros_like(logits, dtype=torch.bool)
    if heavy_budget > 0:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        accumulated = probs[:, :heavy_budget].sum(dim=-2)
        accumulated[:, heavy_budget:] = 0
        keep[:, :heavy_budget, :heavy_budget] = True
        for token in range(heavy_budget, length):
            top = accumulated.topk(k=heavy_budget - 1, dim=-1).indices
            row = torch.zeros_like(accumulated, dtype=torch.bool).scatter(-1, top, True)
            row[:, token] = True
            keep[:, token] = row
            accumulated = (accumulated + probs[:, token]) * row
    return (keep | torch.ones_like(keep).triu(diagonal=-recent_budget)).tril()
