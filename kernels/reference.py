"""PyTorch references of the Triton kernels beside this file; also the CPU path, so they import no Triton.

The third kernel, ``eviction_scan``, has the mechanism's own definition as its reference:
:func:`h2o_eval.eviction.attend_chunk_reference`.
"""

from __future__ import annotations

import torch


def visible(valid: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[B, rows, cols] causal visibility: key j is seen from row i if j <= i and j is a real token; a padding
    row sees itself too, so every row's softmax is defined."""
    causal = cols.view(1, 1, -1) <= rows.view(1, -1, 1)
    own = cols.view(1, 1, -1) == rows.view(1, -1, 1)
    return causal & (valid[:, cols].unsqueeze(1) | own)


def column_scores_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over a whole prompt and each key's weighted column sum of its probabilities.

    query [B, Hq, T, D]; key, value [B, Hkv, T, D] (Hq = G * Hkv, query head h*G+g reads KV head h);
    valid [B, T] bool (False: padding); weights [B, T] float, one per query row.
    Returns the output [B, Hq, T, D] in the query's dtype and columns [B, Hkv, T] float32, where
    columns[b, h, j] = sum_i weights[b, i] * sum_g P[b, h*G+g, i, j]. Rows are processed ``block`` at a time,
    so the T x T matrix never exists whole.
    """
    batch, q_heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    keys = key.float().transpose(-1, -2)
    output = torch.empty_like(query)
    columns = torch.zeros(batch, kv_heads, length, dtype=torch.float32, device=query.device)
    cols = torch.arange(length, device=query.device)
    for start in range(0, length, block):
        stop = min(start + block, length)
        grouped = query[:, :, start:stop].float().reshape(batch, kv_heads, group * (stop - start), dim)
        logits = (torch.matmul(grouped, keys) * scaling).view(batch, kv_heads, group, stop - start, length)
        seen = visible(valid, cols[start:stop], cols)
        probs = torch.softmax(logits.masked_fill(~seen[:, None, None], -torch.inf), dim=-1)
        out = torch.matmul(probs.view(batch, kv_heads, -1, length), value.float())
        output[:, :, start:stop] = out.view(batch, q_heads, stop - start, dim).to(query.dtype)
        columns += torch.einsum("bhgrn,br->bhn", probs, weights[:, start:stop].float())
    return output, columns


def decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: torch.Tensor,
    scores: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One query per sequence [B, Hq, D] against the held slots of keys/values [B, Hkv, S, D] (held [B, Hkv, S]).

    Softmax over the held slots of each KV head for its G query heads; adds the probabilities, summed over
    the group, into ``scores`` [B, Hkv, S] float32. Returns the output [B, Hq, D] in the query's dtype.
    """
    batch, q_heads, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.float().view(batch, kv_heads, q_heads // kv_heads, dim)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scaling
    probs = torch.softmax(logits.masked_fill(~held.unsqueeze(2), -torch.inf), dim=-1)
    scores += probs.sum(dim=2)
    return torch.matmul(probs, values.float()).view(batch, q_heads, dim).to(query.dtype)
