"""Decode attention with scores: one new query per sequence against the kept cache, split across programs.

A decode step reads every held key and value once, so it is bound by memory bandwidth, and one program per
(sequence, KV head) leaves most of the GPU idle (B x Hkv programs, 8 at batch 1 on Llama-3-8B). Flash-decoding
splits each head's slots into ranges and gives each range a program, grid (B * Hkv, splits):

1. :func:`_partials_kernel`: each split runs an online softmax of the group's G queries over its held slots and
   stores its partials (row max, normaliser, unnormalised output) and its scaled logits, in a float32 workspace
   of G values per slot, so that pass 2 reads 4G bytes a slot where reloading the key would read 2D;
2. :func:`_combine_kernel`: each split combines every split's (max, normaliser) into the global ones; split 0
   writes the output, and each split adds its held slots' exact probabilities exp(logit - max) / normaliser,
   summed over the group, into ``scores``.

Keys and values are read in their own dtype and multiplied with ``tl.dot`` accumulating in float32 (tensor
cores for fp16/bf16, IEEE float32 for float32 inputs). The host code picks the split count from shapes alone
and reads no tensor's value, so a decode step never waits for the device.

Shapes: query [B, Hq, D]; keys, values [B, Hkv, S, D]; held [B, Hkv, S] bool; scores [B, Hkv, S] float32
(updated in place); output [B, Hq, D]. :func:`h2o_eval.kernels.reference.decode_attention_reference` is the
PyTorch definition. :func:`slot_block`, :func:`group_block` and :func:`dot_precision` are shared with the
chunked eviction scan (``eviction_scan.py``).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

PROGRAMS_PER_SM = 4  # programs a decode step aims for per streaming multiprocessor
CPU_SMS = 16  # stands in for the SM count where there is no CUDA device (Triton's interpreter)
MAX_SPLITS = 128  # pass 2 holds every split's (max, normaliser) of the group in registers


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: IEEE float32 for float32 tiles (TF32 would round them); fp16/bf16 tiles go to
    the tensor cores as they are, where the setting does not apply."""
    return "ieee" if dtype == torch.float32 else "tf32"


def group_block(group: int) -> int:
    """Rows of the query tile: the group's heads, padded to the 16 that ``tl.dot`` needs at least."""
    return max(16, triton.next_power_of_2(group))


@lru_cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def split_slots(batch_heads: int, slots: int, block_slots: int, device: torch.device) -> tuple[int, int]:
    """(splits, slots per split) for ``batch_heads`` = B * Hkv heads of ``slots`` slots: enough splits for
    :data:`PROGRAMS_PER_SM` programs per SM, at most :data:`MAX_SPLITS`, each a whole number of ``block_slots``
    blocks (the last split may be partial); one split when the slots fit in one block."""
    blocks = triton.cdiv(max(slots, 1), block_slots)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), batch_heads)
    per_split = triton.cdiv(blocks, max(1, min(wanted, blocks, MAX_SPLITS))) * block_slots
    return triton.cdiv(max(slots, 1), per_split), per_split


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
def _partials_kernel(
    q_ptr, k_ptr, v_ptr, held_ptr, logits_ptr, top_ptr, total_ptr, acc_ptr,
    slots, per_split, scaling,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_hb, stride_hh,
    kv_heads: tl.constexpr, group: tl.constexpr, dim: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Pass 1, program (b * Hkv + h, split): the split's online-softmax partials over its held slots, stored at
    [b * Hkv + h, split] of top/total [.., splits, G] and acc [.., splits, G, D]; its logits at logits
    [b * Hkv + h, G, S] (held slots only)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    d = tl.arange(0, dim)
    q_ptrs = q_ptr + b * stride_qb + (h * group + g)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0).to(k_ptr.dtype.element_ty)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    held_base = held_ptr + b * stride_hb + h * stride_hh
    logits_base = logits_ptr + bh * group * slots
    start = split * per_split
    stop = tl.minimum(start + per_split, slots)
    top = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, dim), tl.float32)
    for first in range(start, stop, BLOCK_S):
        s, ok = slot_block(first, stop, held_base, held_base, BLOCK_S, False)
        k = tl.load(k_base + s[:, None] * stride_ks + d[None, :], mask=ok[:, None], other=0.0)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        logits = tl.where(ok[None, :], logits, float("-inf"))
        tl.store(logits_base + g[:, None] * slots + s[None, :], logits, mask=g_ok[:, None] & ok[None, :])
        v = tl.load(v_base + s[:, None] * stride_vs + d[None, :], mask=ok[:, None], other=0.0)
        new_top = tl.maximum(top, tl.max(logits, axis=1))
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
        p = tl.exp(logits - safe_top[:, None])
        rescale = tl.exp(top - safe_top)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    part = bh * tl.num_programs(1) + split
    tl.store(top_ptr + part * group + g, top, mask=g_ok)
    tl.store(total_ptr + part * group + g, total, mask=g_ok)
    tl.store(acc_ptr + (part * group + g)[:, None] * dim + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _combine_kernel(
    top_ptr, total_ptr, acc_ptr, logits_ptr, held_ptr, scores_ptr, out_ptr,
    slots, per_split,
    stride_hb, stride_hh,
    stride_sb, stride_sh,
    stride_ob, stride_oh,
    kv_heads: tl.constexpr, group: tl.constexpr, dim: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Pass 2, program (b * Hkv + h, split): the global max and normaliser of the group's queries from every
    split's partials; split 0 stores the output, every split adds its held slots' probabilities into scores."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = bh // kv_heads
    h = bh % kv_heads
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    parts = tl.arange(0, SPLITS)
    both = (parts < splits)[:, None] & g_ok[None, :]
    at = (bh * splits + parts)[:, None] * group + g[None, :]
    tops = tl.load(top_ptr + at, mask=both, other=float("-inf"))
    top = tl.max(tops, axis=0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(tops - safe_top[None, :])
    total = tl.sum(tl.load(total_ptr + at, mask=both, other=0.0) * weight, axis=0)
    total = tl.where(g_ok, total, 1.0)
    if split == 0:
        d = tl.arange(0, dim)
        acc = tl.zeros((BLOCK_G, dim), tl.float32)
        for part in range(bh * splits, (bh + 1) * splits):
            rescale = tl.exp(tl.load(top_ptr + part * group + g, mask=g_ok, other=float("-inf")) - safe_top)
            rows = tl.load(acc_ptr + (part * group + g)[:, None] * dim + d[None, :], mask=g_ok[:, None], other=0.0)
            acc += rows * rescale[:, None]
        out = acc / total[:, None]
        o_ptrs = out_ptr + b * stride_ob + (h * group + g)[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    held_base = held_ptr + b * stride_hb + h * stride_hh
    scores_base = scores_ptr + b * stride_sb + h * stride_sh
    logits_base = logits_ptr + bh * group * slots
    start = split * per_split
    stop = tl.minimum(start + per_split, slots)
    for first in range(start, stop, BLOCK_S):
        s, ok = slot_block(first, stop, held_base, held_base, BLOCK_S, False)
        logits = tl.load(logits_base + g[:, None] * slots + s[None, :], mask=g_ok[:, None] & ok[None, :], other=0.0)
        p = tl.where(g_ok[:, None] & ok[None, :], tl.exp(logits - safe_top[:, None]) / total[:, None], 0.0)
        column = tl.sum(p, axis=0)
        tl.store(scores_base + s, tl.load(scores_base + s, mask=ok, other=0.0) + column, mask=ok)


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: torch.Tensor,
    scores: torch.Tensor,
    scaling: float,
    block_slots: int = 64,
    splits: int | None = None,
) -> torch.Tensor:
    """The Triton kernels with :func:`~h2o_eval.kernels.reference.decode_attention_reference`'s contract: query
    [B, Hq, D] against the held slots of keys/values [B, Hkv, S, D] (held [B, Hkv, S] bool); ``scores``
    [B, Hkv, S] float32 gains each held slot's probability summed over the KV head's G query heads (slots not
    held keep theirs). Returns the output [B, Hq, D] in the query's dtype.

    ``block_slots``: slots per tile. ``splits``: programs per (sequence, KV head), by default
    :func:`split_slots`'s choice from the shapes; each split covers a whole number of tiles, so the count used is
    at most the number of tiles. Nothing here reads a tensor's value (no device synchronisation).
    """
    batch, q_heads, dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    if splits is None:
        splits, per_split = split_slots(batch * kv_heads, slots, block_slots, query.device)
    else:
        per_split = triton.cdiv(triton.cdiv(max(slots, 1), splits), block_slots) * block_slots
        splits = triton.cdiv(max(slots, 1), per_split)
    if scores.stride(-1) != 1:
        raise ValueError("decode_attention: scores must be contiguous along the slots (it is updated in place)")
    query, keys, values, held = (_last_dim_contiguous(t) for t in (query, keys, values, held))
    held = held.view(torch.int8) if held.dtype == torch.bool else held.to(torch.int8)
    heads = batch * kv_heads
    sizes = (heads * group * slots, heads * splits * group, heads * splits * group, heads * splits * group * dim)
    workspace = torch.empty(sum(sizes), dtype=torch.float32, device=query.device)  # one allocation per step
    logits, top, total, acc = workspace.split(sizes)
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    shapes = {"kv_heads": kv_heads, "group": group, "dim": dim, "BLOCK_G": group_block(group), "BLOCK_S": block_slots}
    _partials_kernel[(heads, splits)](
        query, keys, values, held, logits, top, total, acc,
        slots, per_split, scaling,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        held.stride(0), held.stride(1),
        PRECISION=dot_precision(keys.dtype), **shapes,
    )  # fmt: skip
    _combine_kernel[(heads, splits)](
        top, total, acc, logits, held, scores, output,
        slots, per_split,
        held.stride(0), held.stride(1),
        scores.stride(0), scores.stride(1),
        output.stride(0), output.stride(1),
        SPLITS=triton.next_power_of_2(splits), **shapes,
    )  # fmt: skip
    return output
