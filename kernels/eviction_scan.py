"""Chunked eviction attention: the decode phase's per-row scan in one kernel.

One program per (sequence, KV head) walks the chunk's rows in order, as a cache fed token by token would:
evict the lowest-scored unprotected slot if the cache is full (ties: the smallest position), admit the row's
token, attend the group's G queries over the held slots (online softmax), and add the probabilities into the
scores, replace them, or leave them (the rule's ``decode_votes``). Held flags and scores stay
with the program across rows (a per-program slice of global memory that lives in L1/L2), with a compact list of
the held slots, so a row costs O(capacity), not O(slots); nothing of size rows x slots is ever materialised,
where the PyTorch paths build the full logits first. A row's attention and score update
(:func:`attend_group`, :func:`update_scores`) multiply float32 tiles in IEEE precision, the slot blocks come
from the decode kernel's :func:`~h2o_eval.kernels.decode_attention.slot_block`.

The reference is the mechanism's own definition, :func:`h2o_eval.eviction.attend_chunk_reference`; the
arguments are the fields of its :class:`~h2o_eval.eviction.Chunk`. Shapes: query [B, Hq, n, D]; key, value
[B, Hkv, N, D] (N = S state slots + n new); held [B, Hkv, N] bool; arriving [B, n] bool; position [B, Hkv, N]
int64; scores [B, Hkv, N] float32; capacity [B, Hkv] int64; recent, sinks [B] int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2o_eval.kernels.decode_attention import group_block, slot_block

REPLACE = tl.constexpr(1)  # decode votes: 0 adds the attention into the scores, 1 replaces them, 2 leaves them
_NONE = tl.constexpr(2**62)


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
def _victim(list_base, scores_base, pos_base, count, now, recent, sinks, BLOCK_S: tl.constexpr):
    """Index in the held list of the slot outside the protected ones (the ``recent`` newest, the first
    ``sinks``) with the lowest score, the smallest position among equal scores; -1 if there is none."""
    best_score = tl.full([], float("inf"), tl.float32)
    best_pos = tl.full([], _NONE, tl.int64)
    best = tl.full([], -1, tl.int64)
    for start in range(0, count, BLOCK_S):
        j = start + tl.arange(0, BLOCK_S)
        ok = j < count
        s = tl.load(list_base + j, mask=ok, other=0)
        pos = tl.load(pos_base + s, mask=ok, other=0)
        candidate = ok & (pos <= now - recent) & (pos >= sinks)
        score = tl.where(candidate, tl.load(scores_base + s, mask=ok, other=0.0), float("inf"))
        low = tl.min(score, axis=0)
        tied = candidate & (score == low)
        low_pos = tl.min(tl.where(tied, pos, _NONE), axis=0)
        low_j = tl.min(tl.where(tied & (pos == low_pos), j.to(tl.int64), _NONE), axis=0)
        better = (low < best_score) | ((low == best_score) & (low_pos < best_pos))
        best_score = tl.where(better, low, best_score)
        best_pos = tl.where(better, low_pos, best_pos)
        best = tl.where(better, low_j, best)
    return best


@triton.jit
def _eviction_scan_kernel(
    q_ptr, k_ptr, v_ptr, held_ptr, list_ptr, arriving_ptr, pos_ptr, scores_ptr, out_ptr, stuck_ptr,
    capacity_ptr, recent_ptr, sinks_ptr,
    n, slots, scaling,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_hb, stride_hh,
    stride_ab,
    stride_pb, stride_ph,
    stride_sb, stride_sh,
    stride_ob, stride_oh, stride_ot,
    kv_heads: tl.constexpr, group: tl.constexpr, dim: tl.constexpr, VOTES: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0) // kv_heads
    h = tl.program_id(0) % kv_heads
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    held_base = held_ptr + b * stride_hb + h * stride_hh
    list_base = list_ptr + b * stride_hb + h * stride_hh  # held slots first (compact); same layout as held
    pos_base = pos_ptr + b * stride_pb + h * stride_ph
    scores_base = scores_ptr + b * stride_sb + h * stride_sh
    capacity = tl.load(capacity_ptr + b * kv_heads + h)
    recent = tl.load(recent_ptr + b)
    sinks = tl.load(sinks_ptr + b)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    d = tl.arange(0, dim)
    state = slots - n
    count = tl.zeros([], tl.int64)
    for start in range(0, slots, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        count += tl.sum((tl.load(held_base + s, mask=s < slots, other=0) != 0).to(tl.int64), axis=0)
    stuck = tl.zeros([], tl.int32)
    for r in range(n):
        slot = state + r
        out_base = out_ptr + b * stride_ob + h * group * stride_oh + r * stride_ot
        if tl.load(arriving_ptr + b * stride_ab + r) != 0:
            now = tl.load(pos_base + slot)
            entry = count  # where the new token goes in the held list: the end, or the victim's place
            if count >= capacity:
                victim = _victim(list_base, scores_base, pos_base, count, now, recent, sinks, BLOCK_S)
                if victim >= 0:
                    tl.store(held_base + tl.load(list_base + victim), 0)
                    entry = victim
                    count -= 1
                else:
                    stuck = 1
            tl.store(list_base + entry, slot)
            tl.store(held_base + slot, 1)
            count += 1
            tl.debug_barrier()
            q_ptrs = q_ptr + b * stride_qb + (h * group + g)[:, None] * stride_qh + r * stride_qt + d[None, :]
            q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0).to(tl.float32)
            top, total = attend_group(
                q, k_base, v_base, held_base, list_base, out_base,
                stride_ks, stride_vs, stride_oh, count, scaling, g_ok, dim, BLOCK_S, True,
            )  # fmt: skip
            if VOTES <= REPLACE:
                update_scores(
                    q, k_base, held_base, list_base, scores_base,
                    stride_ks, count, scaling, top, total, g_ok, VOTES == REPLACE, dim, BLOCK_S, True,
                )  # fmt: skip
                tl.debug_barrier()
        else:  # padding: never enters; its (unused) output is its own value, as if it attended to itself
            own = tl.load(v_base + slot * stride_vs + d).to(tl.float32)[None, :] + tl.zeros((BLOCK_G, dim), tl.float32)
            tl.store(out_base + g[:, None] * stride_oh + d[None, :], own, mask=g_ok[:, None])
    tl.store(stuck_ptr + b * kv_heads + h, stuck)


def eviction_scan(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    held: torch.Tensor,
    arriving: torch.Tensor,
    position: torch.Tensor,
    scores: torch.Tensor,
    capacity: torch.Tensor,
    recent: torch.Tensor,
    sinks: torch.Tensor,
    votes: int,
    scaling: float,
    block_slots: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the scan; returns (output [B, Hq, n, D] in the query's dtype, held, scores) like the reference.

    ``votes`` (the rule's ``decode_votes``): 0 adds each row's attention into the scores, 1 replaces them, 2
    leaves them as given.
    """
    batch, q_heads, n, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    held_list = torch.argsort((~held).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous()
    held = held.to(torch.int8).contiguous()
    arriving = arriving.to(torch.int8).contiguous()
    position = position.to(torch.int64).contiguous()
    scores = scores.float().clone().contiguous()
    output = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    stuck = torch.zeros(batch, kv_heads, dtype=torch.int32, device=query.device)
    plan = [x.to(device=query.device, dtype=torch.int64).contiguous() for x in (capacity, recent, sinks)]
    _eviction_scan_kernel[(batch * kv_heads,)](
        query, key, value, held, held_list, arriving, position, scores, output, stuck,
        *plan,
        n, slots, scaling,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        held.stride(0), held.stride(1),
        arriving.stride(0),
        position.stride(0), position.stride(1),
        scores.stride(0), scores.stride(1),
        output.stride(0), output.stride(1), output.stride(2),
        kv_heads=kv_heads, group=group, dim=dim, VOTES=votes, BLOCK_G=group_block(group), BLOCK_S=block_slots,
    )  # fmt: skip
    if bool(stuck.any()):
        raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")
    return output.to(query.dtype), held.bool(), scores
