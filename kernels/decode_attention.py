"""Decode attention with scores: one new query per sequence against the kept cache, in one kernel.

Each program owns one (sequence, KV head): it loads the G query heads of the group, runs an online softmax over
the held slots (variable per KV head: ``held`` masks the rest), writes the attention output, then adds each
slot's probability, summed over the group, into ``scores`` — the H2O accumulation of a decode step.

Shapes: query [B, Hq, D]; keys, values [B, Hkv, S, D]; held [B, Hkv, S] bool; scores [B, Hkv, S] float32
(updated in place); output [B, Hq, D]. :func:`decode_attention_reference` is the PyTorch definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: torch.Tensor,
    scores: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Softmax over the held slots of each KV head for its G query heads; adds the probabilities, summed over
    the group, into ``scores``. Returns the output [B, Hq, D] in the query's dtype."""
    batch, q_heads, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.float().view(batch, kv_heads, q_heads // kv_heads, dim)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scaling
    probs = torch.softmax(logits.masked_fill(~held.unsqueeze(2), -torch.inf), dim=-1)
    scores += probs.sum(dim=2)
    return torch.matmul(probs, values.float()).view(batch, q_heads, dim).to(query.dtype)


@triton.jit
def _block_logits(q, k_base, held_base, stride_ks, start, slots, scaling, dim: tl.constexpr, BLOCK_S: tl.constexpr):
    """Logits [BLOCK_G, BLOCK_S] of the group's queries against one block of slots (-inf where not held)."""
    s = start + tl.arange(0, BLOCK_S)
    s_ok = s < slots
    is_held = tl.load(held_base + s, mask=s_ok, other=0) != 0
    k = tl.load(k_base + s[:, None] * stride_ks + tl.arange(0, dim)[None, :], mask=s_ok[:, None], other=0.0)
    return tl.where(is_held[None, :], tl.dot(q, tl.trans(k.to(tl.float32))) * scaling, float("-inf")), s, s_ok


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, held_ptr, scores_ptr, out_ptr,
    slots, scaling,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_hb, stride_hh,
    stride_sb, stride_sh,
    stride_ob, stride_oh,
    kv_heads: tl.constexpr, group: tl.constexpr, dim: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // kv_heads
    h = pid % kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, dim)
    g_ok = g < group
    q = tl.load(
        q_ptr + b * stride_qb + (h * group + g)[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0
    ).to(tl.float32)
    top = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, dim), tl.float32)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    held_base = held_ptr + b * stride_hb + h * stride_hh
    for start in range(0, slots, BLOCK_S):
        logits, s, s_ok = _block_logits(q, k_base, held_base, stride_ks, start, slots, scaling, dim, BLOCK_S)
        v = tl.load(
            v_ptr + b * stride_vb + h * stride_vh + s[:, None] * stride_vs + d[None, :], mask=s_ok[:, None], other=0.0
        ).to(tl.float32)
        new_top = tl.maximum(top, tl.max(logits, axis=1))
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
        p = tl.exp(logits - safe_top[:, None])
        rescale = tl.exp(top - safe_top)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p, v)
        top = new_top
    out = acc / total[:, None]
    tl.store(
        out_ptr + b * stride_ob + (h * group + g)[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None],
    )
    for start in range(0, slots, BLOCK_S):
        logits, s, s_ok = _block_logits(q, k_base, held_base, stride_ks, start, slots, scaling, dim, BLOCK_S)
        p = tl.exp(logits - top[:, None]) / total[:, None]
        p = tl.where(g_ok[:, None], p, 0.0)
        column = scores_ptr + b * stride_sb + h * stride_sh + s
        tl.store(column, tl.load(column, mask=s_ok, other=0.0) + tl.sum(p, axis=0), mask=s_ok)


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: torch.Tensor,
    scores: torch.Tensor,
    scaling: float,
    block_slots: int = 64,
) -> torch.Tensor:
    """The Triton kernel with :func:`decode_attention_reference`'s contract (``scores`` updated in place)."""
    batch, q_heads, dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()
    held = held.to(torch.int8).contiguous()
    output = torch.empty_like(query)
    _decode_attention_kernel[(batch * kv_heads,)](
        query, keys, values, held, scores, output,
        slots, scaling,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        held.stride(0), held.stride(1),
        scores.stride(0), scores.stride(1),
        output.stride(0), output.stride(1),
        kv_heads=kv_heads, group=group, dim=dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_S=block_slots,
    )  # fmt: skip
    return output
