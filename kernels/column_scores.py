"""Prompt votes on the GPU: each key's probabilities summed over the rows that vote, in one pass over the keys.

:func:`column_sums` is what the prompt pass adds to the model's own attention: one program per (sequence, KV
head, block of keys) recomputes the logits of the voting rows of the group's G query heads against its keys,
turns them into probabilities with each row's log-sum-exp (from the attention that produced the output) and sums
them, weighted per row, down the columns. It visits only the rows from each sequence's first voter on (SnapKV's
last ``window`` rows, TOVA's last row), and only the rows at or after the block's first key (causal).

:func:`attention_lse` is the attention with each row's log-sum-exp where torch's fused kernels cannot give it
(:func:`h2o_eval.kernels.prompt.fused_attention_lse`): padded batches (torch's flash kernels take no mask),
float32 inputs, and the log-sum-exp of the voting rows alone when the output is not wanted.

:func:`h2o_eval.kernels.prompt.prompt_votes` runs them. Both multiply tiles in the inputs' dtype with ``tl.dot``
accumulating in float32 (tensor cores for fp16/bf16). Shapes: query [B, Hq, T, D]; key, value [B, Hkv, T, D];
valid [B, T] bool (False: padding, which a row sees only as itself); weights [B, T] float; lse [B, Hq, T]
float32; columns [B, Hkv, T] float32. The PyTorch definitions are
:func:`~h2o_eval.kernels.reference.attention_lse_reference` and
:func:`~h2o_eval.kernels.reference.column_sums_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2o_eval.kernels.decode_attention import dot_precision
from h2o_eval.kernels.reference import first_voters


@triton.jit
def _softmax_tile(
    q, k_ptrs, v_ptrs, k_ok, seen, top, total, acc, scaling, PRECISION: tl.constexpr, OUTPUT: tl.constexpr
):  # fmt: skip
    """One key tile of an online softmax: (top, total, acc) updated with the rows' logits where ``seen``
    (``k_ok``: the tile's keys inside the prompt)."""
    k = tl.load(k_ptrs, mask=k_ok[:, None], other=0.0)
    logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
    logits = tl.where(seen, logits, float("-inf"))
    new_top = tl.maximum(top, tl.max(logits, axis=1))
    safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
    p = tl.exp(logits - safe_top[:, None])
    rescale = tl.exp(top - safe_top)
    total = total * rescale + tl.sum(p, axis=1)
    if OUTPUT:
        v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return new_top, total, acc


@triton.jit
def _rows_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, start_ptr, out_ptr, lse_ptr,
    length, scaling,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_validb,
    stride_ob, stride_oh, stride_ot,
    stride_lb, stride_lh,
    q_heads: tl.constexpr, group: tl.constexpr, dim: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, OUTPUT: tl.constexpr,
):  # fmt: skip
    """Program (block of rows, b * Hq + head): flash attention of the rows, storing each row's log-sum-exp from
    start[b] on and, with ``OUTPUT``, its output. A block wholly before start[b] does nothing. Keys before the
    block's first row are masked by padding alone; the keys of the block's own rows also causally."""
    block = tl.program_id(0)
    b = tl.program_id(1) // q_heads
    head = tl.program_id(1) % q_heads
    kv = head // group
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    first = tl.load(start_ptr + b)
    wanted = (block + 1) * BLOCK_M > first
    d = tl.arange(0, dim)
    q_ptrs = q_ptr + b * stride_qb + head * stride_qh + rows[:, None] * stride_qt + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(k_ptr.dtype.element_ty)
    k_base = k_ptr + b * stride_kb + kv * stride_kh
    v_base = v_ptr + b * stride_vb + kv * stride_vh
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, dim), tl.float32)
    before = tl.where(wanted, block * BLOCK_M, 0)  # keys every row of the block comes after
    end = tl.where(wanted, tl.minimum((block + 1) * BLOCK_M, length), 0)
    for start in range(0, before, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = tl.load(valid_ptr + b * stride_validb + cols) != 0
        seen = row_ok[:, None] & col_ok[None, :]
        top, total, acc = _softmax_tile(
            q, k_base + cols[:, None] * stride_kt + d[None, :], v_base + cols[:, None] * stride_vt + d[None, :],
            cols < length, seen, top, total, acc, scaling, PRECISION, OUTPUT,
        )  # fmt: skip
    for start in range(before, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = tl.load(valid_ptr + b * stride_validb + cols, mask=cols < length, other=0) != 0
        own = cols[None, :] == rows[:, None]
        seen = row_ok[:, None] & (cols[None, :] <= rows[:, None]) & (col_ok[None, :] | own)
        top, total, acc = _softmax_tile(
            q, k_base + cols[:, None] * stride_kt + d[None, :], v_base + cols[:, None] * stride_vt + d[None, :],
            cols < length, seen, top, total, acc, scaling, PRECISION, OUTPUT,
        )  # fmt: skip
    total = tl.where(total > 0, total, 1.0)  # 0 only in rows not computed: past the end, or a block skipped
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + rows, top + tl.log(total), mask=row_ok & (rows >= first))
    if OUTPUT:
        o_ptrs = out_ptr + b * stride_ob + head * stride_oh + rows[:, None] * stride_ot + d[None, :]
        tl.store(o_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _column_tile(
    acc, q_base, lse_base, weights_base, k, rows, cols, col_ok, length, scaling, stride_qh, stride_qt, stride_lh,
    group: tl.constexpr, dim: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] += each voting row's weighted probabilities of the keys, over the group's heads.
    ``CAUSAL``: the rows may precede some keys (and see a padding key only as their own)."""
    row_ok = rows < length
    weight = tl.load(weights_base + rows, mask=row_ok, other=0.0)
    voting = weight != 0
    if CAUSAL:
        own = cols[None, :] == rows[:, None]
        seen = voting[:, None] & (cols[None, :] <= rows[:, None]) & (col_ok[None, :] | own)
    else:
        seen = voting[:, None] & col_ok[None, :]
    d = tl.arange(0, dim)
    for g in range(group):
        q = tl.load(q_base + g * stride_qh + rows[:, None] * stride_qt + d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_base + g * stride_lh + rows, mask=voting, other=0.0)
        logits = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * scaling
        acc += tl.where(seen, tl.exp(logits - lse[:, None]), 0.0) * weight[:, None]
    return acc


@triton.jit
def _columns_kernel(
    q_ptr, k_ptr, valid_ptr, lse_ptr, weights_ptr, first_ptr, columns_ptr,
    length, scaling,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_validb,
    stride_lb, stride_lh,
    stride_wb,
    stride_cb, stride_ch,
    kv_heads: tl.constexpr, group: tl.constexpr, dim: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (block of keys, b * Hkv + kv): the keys' weighted column sums over the rows from
    max(first key, first[b]) on. Row tiles that start before the block's last key are masked causally, the
    later ones by padding alone."""
    block = tl.program_id(0)
    b = tl.program_id(1) // kv_heads
    kv = tl.program_id(1) % kv_heads
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < length
    d = tl.arange(0, dim)
    k_ptrs = k_ptr + b * stride_kb + kv * stride_kh + cols[:, None] * stride_kt + d[None, :]
    k = tl.load(k_ptrs, mask=col_in[:, None], other=0.0)
    col_ok = tl.load(valid_ptr + b * stride_validb + cols, mask=col_in, other=0) != 0
    q_base = q_ptr + b * stride_qb + kv * group * stride_qh
    lse_base = lse_ptr + b * stride_lb + kv * group * stride_lh
    weights_base = weights_ptr + b * stride_wb
    start = tl.maximum(block * BLOCK_N, tl.load(first_ptr + b))
    causal_end = start + tl.cdiv(tl.maximum(block * BLOCK_N + BLOCK_N - start, 0), BLOCK_M) * BLOCK_M
    causal_end = tl.minimum(causal_end, length)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for row in range(start, causal_end, BLOCK_M):
        acc = _column_tile(
            acc, q_base, lse_base, weights_base, k, row + tl.arange(0, BLOCK_M), cols, col_ok, length, scaling,
            stride_qh, stride_qt, stride_lh, group, dim, PRECISION, True,
        )  # fmt: skip
    for row in range(causal_end, length, BLOCK_M):
        acc = _column_tile(
            acc, q_base, lse_base, weights_base, k, row + tl.arange(0, BLOCK_M), cols, col_ok, length, scaling,
            stride_qh, stride_qt, stride_lh, group, dim, PRECISION, False,
        )  # fmt: skip
    tl.store(columns_ptr + b * stride_cb + kv * stride_ch + cols, tl.sum(acc, axis=0), mask=col_in)


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def attention_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    start: torch.Tensor | None = None,
    block_rows: int = 64,
    block_cols: int = 64,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The Triton kernel with :func:`~h2o_eval.kernels.reference.attention_lse_reference`'s contract: causal
    attention over the prompt (padding seen only as a row's own slot) and each row's log-sum-exp, natural log of
    the scaled logits, lse [B, Hq, T] float32. ``start`` [B] int64: only rows from start[b] on are wanted, no
    output is computed (None), the rows before it are left NaN and the tiles of ``block_rows`` rows wholly before
    it cost nothing; None: every
    row, with the output [B, Hq, T, D] in the query's dtype. ``block_rows`` must be a multiple of
    ``block_cols``."""
    if block_rows % block_cols:
        raise ValueError(f"attention_lse: block_rows={block_rows} must be a multiple of block_cols={block_cols}")
    batch, q_heads, length, dim = query.shape
    group = q_heads // key.shape[1]
    query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
    valid = valid.to(torch.int8).contiguous()
    output = None if start is not None else torch.empty(query.shape, dtype=query.dtype, device=query.device)
    out = output if output is not None else query  # never written without an output
    if start is None:
        start = torch.zeros(batch, dtype=torch.int64, device=query.device)
    lse = torch.full((batch, q_heads, length), float("nan"), dtype=torch.float32, device=query.device)
    _rows_kernel[(triton.cdiv(length, block_rows), batch * q_heads)](
        query, key, value, valid, start.contiguous(), out, lse,
        length, scaling,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        valid.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        q_heads=q_heads, group=group, dim=dim, BLOCK_M=block_rows, BLOCK_N=block_cols,
        PRECISION=dot_precision(key.dtype), OUTPUT=output is not None,
    )  # fmt: skip
    return output, lse


def column_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor,
    lse: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
    block_rows: int = 64,
    block_cols: int = 64,
) -> torch.Tensor:
    """The Triton kernel with :func:`~h2o_eval.kernels.reference.column_sums_reference`'s contract: columns
    [B, Hkv, T] float32, columns[b, h, j] = sum_i weights[b, i] sum_g exp(scaling q[b, hG+g, i] . k[b, h, j] -
    lse[b, hG+g, i]) over the rows i that see key j. Rows before each sequence's first nonzero weight are never
    read (their lse may be undefined)."""
    batch, q_heads, length, dim = query.shape
    kv_heads = key.shape[1]
    query, key = _last_dim_contiguous(query), _last_dim_contiguous(key)
    valid = valid.to(torch.int8).contiguous()
    weights = weights.float().contiguous()
    lse = lse.contiguous()
    columns = torch.empty(batch, kv_heads, length, dtype=torch.float32, device=query.device)
    _columns_kernel[(triton.cdiv(length, block_cols), batch * kv_heads)](
        query, key, valid, lse, weights, first_voters(weights), columns,
        length, scaling,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        valid.stride(0),
        lse.stride(0), lse.stride(1),
        weights.stride(0),
        columns.stride(0), columns.stride(1),
        kv_heads=kv_heads, group=q_heads // kv_heads, dim=dim, BLOCK_M=block_rows, BLOCK_N=block_cols,
        PRECISION=dot_precision(key.dtype),
    )  # fmt: skip
    return columns
