"""Decode attention with scores: one new query per sequence against the kept cache, in one kernel.

Each program owns one (sequence, KV head): it loads the G query heads of the group, runs an online softmax over
the held slots (variable per KV head: ``held`` masks the rest), writes the attention output, then adds each
slot's probability, summed over the group, into ``scores`` — the H2O accumulation of a decode step.

Shapes: query [B, Hq, D]; keys, values [B, Hkv, S, D]; held [B, Hkv, S] bool; scores [B, Hkv, S] float32
(updated in place); output [B, Hq, D]. :func:`h2o_eval.kernels.reference.decode_attention_reference` is the
PyTorch definition. :func:`attend_group` and :func:`update_scores` are the step's two passes, shared with the
chunked eviction scan (``eviction_scan.py``), which runs them once per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def slot_block(start, count, list_base, held_base, BLOCK_S: tl.constexpr, LISTED: tl.constexpr):
    """One block of slots to visit: (slot indices, which of them count). ``LISTED``: entries start.. of a compact
    list of the held slots (``count`` long); otherwise slots start.. below ``count`` that are held."""
    j = start + tl.arange(0, BLOCK_S)
    if LISTED:
        ok = j < count
        s = tl.load(list_base + j, mask=ok, other=0)
    else:
        ok = (j < count) & (tl.load(held_base + j, mask=j < count, other=0) != 0)
        s = j
    return s, ok


@triton.jit
def _block_logits(q, k_base, s, ok, stride_ks, scaling, dim: tl.constexpr):
    """Logits [BLOCK_G, BLOCK_S] of the group's queries against the slots ``s`` (-inf where not ``ok``)."""
    k = tl.load(k_base + s[:, None] * stride_ks + tl.arange(0, dim)[None, :], mask=ok[:, None], other=0.0)
    logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scaling
    return tl.where(ok[None, :], logits, float("-inf"))


@triton.jit
def attend_group(
    q, k_base, v_base, held_base, list_base, out_base, stride_ks, stride_vs, stride_oh, count, scaling, g_ok,
    dim: tl.constexpr, BLOCK_S: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """Online softmax of the group's queries q [BLOCK_G, dim] over the held slots (see :func:`slot_block`);
    stores the output rows (stride ``stride_oh`` between query heads), returns the row max and normaliser."""
    d = tl.arange(0, dim)
    top = tl.full((q.shape[0],), float("-inf"), tl.float32)
    total = tl.zeros((q.shape[0],), tl.float32)
    acc = tl.zeros((q.shape[0], dim), tl.float32)
    for start in range(0, count, BLOCK_S):
        s, ok = slot_block(start, count, list_base, held_base, BLOCK_S, LISTED)
        logits = _block_logits(q, k_base, s, ok, stride_ks, scaling, dim)
        v = tl.load(v_base + s[:, None] * stride_vs + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        new_top = tl.maximum(top, tl.max(logits, axis=1))
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
        p = tl.exp(logits - safe_top[:, None])
        rescale = tl.exp(top - safe_top)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        top = new_top
    total = tl.where(g_ok, total, 1.0)
    g = tl.arange(0, q.shape[0])
    tl.store(out_base + g[:, None] * stride_oh + d[None, :], acc / total[:, None], mask=g_ok[:, None])
    return top, total


@triton.jit
def update_scores(
    q, k_base, held_base, list_base, scores_base, stride_ks, count, scaling, top, total, g_ok,
    REPLACE: tl.constexpr, dim: tl.constexpr, BLOCK_S: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """Each held slot's probability, summed over the group: added to its score, or (``REPLACE``) its new
    score. Slots not held keep theirs."""
    for start in range(0, count, BLOCK_S):
        s, ok = slot_block(start, count, list_base, held_base, BLOCK_S, LISTED)
        logits = _block_logits(q, k_base, s, ok, stride_ks, scaling, dim)
        p = tl.where(g_ok[:, None], tl.exp(logits - top[:, None]) / total[:, None], 0.0)
        column = tl.sum(p, axis=0)
        if REPLACE:
            tl.store(scores_base + s, column, mask=ok)
        else:
            tl.store(scores_base + s, tl.load(scores_base + s, mask=ok, other=0.0) + column, mask=ok)


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
    b = tl.program_id(0) // kv_heads
    h = tl.program_id(0) % kv_heads
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    q_ptrs = q_ptr + b * stride_qb + (h * group + g)[:, None] * stride_qh + tl.arange(0, dim)[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0).to(tl.float32)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    held_base = held_ptr + b * stride_hb + h * stride_hh
    out_base = out_ptr + b * stride_ob + h * group * stride_oh
    top, total = attend_group(
        q, k_base, v_ptr + b * stride_vb + h * stride_vh, held_base, held_base, out_base,
        stride_ks, stride_vs, stride_oh, slots, scaling, g_ok, dim, BLOCK_S, False,
    )  # fmt: skip
    scores_base = scores_ptr + b * stride_sb + h * stride_sh
    update_scores(
        q, k_base, held_base, held_base, scores_base,
        stride_ks, slots, scaling, top, total, g_ok, False, dim, BLOCK_S, False,
    )  # fmt: skip


def group_block(group: int) -> int:
    """Rows of the query tile: the group's heads, padded to the 16 that ``tl.dot`` needs at least."""
    return max(16, triton.next_power_of_2(group))


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
    output = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    _decode_attention_kernel[(batch * kv_heads,)](
        query, keys, values, held, scores, output,
        slots, scaling,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        held.stride(0), held.stride(1),
        scores.stride(0), scores.stride(1),
        output.stride(0), output.stride(1),
        kv_heads=kv_heads, group=group, dim=dim, BLOCK_G=group_block(group), BLOCK_S=block_slots,
    )  # fmt: skip
    return output.to(query.dtype)
