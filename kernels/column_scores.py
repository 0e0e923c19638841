"""Prefill column scores: causal attention over a prompt and each key's summed probabilities, flash-style.

Two passes, neither materialising the T x T matrix. Pass 1 (one program per query head and block of rows) is
flash attention: an online softmax gives each row's output and its log-sum-exp. Pass 2 (one program per KV
head and block of keys) recomputes the logits of every row of the group against its keys, turns them into
probabilities with the stored log-sum-exp, weights each row and sums down the columns. The output is fused into
pass 1 because it costs one more matmul on tiles already loaded, where a separate call would redo the pass.

Shapes as :func:`h2o_eval.kernels.reference.column_scores_reference`, the PyTorch definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """Tiles are upcast to float32 for the matmuls: TF32 tensor cores hold fp16/bf16 inputs exactly; float32
    inputs get IEEE float32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _visible(rows, cols, col_ok, length):
    """Causal visibility of a [rows, cols] tile: real earlier keys, and each row's own slot."""
    causal = cols[None, :] <= rows[:, None]
    return causal & (col_ok[None, :] | (cols[None, :] == rows[:, None])) & (cols[None, :] < length)


@triton.jit
def _rows_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, out_ptr, lse_ptr,
    length, scaling,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_validb,
    stride_ob, stride_oh, stride_ot,
    stride_lb, stride_lh,
    q_heads: tl.constexpr, group: tl.constexpr, dim: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    b = tl.program_id(1) // q_heads
    head = tl.program_id(1) % q_heads
    kv = head // group
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    d = tl.arange(0, dim)
    q = tl.load(
        q_ptr + b * stride_qb + head * stride_qh + rows[:, None] * stride_qt + d[None, :], mask=row_ok[:, None]
    ).to(tl.float32)
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, dim), tl.float32)
    for start in range(0, tl.minimum((block + 1) * BLOCK_M, length), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_in = cols < length
        k = tl.load(
            k_ptr + b * stride_kb + kv * stride_kh + cols[:, None] * stride_kt + d[None, :], mask=col_in[:, None]
        ).to(tl.float32)
        v = tl.load(
            v_ptr + b * stride_vb + kv * stride_vh + cols[:, None] * stride_vt + d[None, :], mask=col_in[:, None]
        ).to(tl.float32)
        col_ok = tl.load(valid_ptr + b * stride_validb + cols, mask=col_in, other=0) != 0
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        logits = tl.where(_visible(rows, cols, col_ok, length), logits, float("-inf"))
        new_top = tl.maximum(top, tl.max(logits, axis=1))
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
        p = tl.exp(logits - safe_top[:, None])
        rescale = tl.exp(top - safe_top)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision=PRECISION)
        top = new_top
    total = tl.where(row_ok, total, 1.0)
    out = acc / total[:, None]
    o_ptrs = out_ptr + b * stride_ob + head * stride_oh + rows[:, None] * stride_ot + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + rows, top + tl.log(total), mask=row_ok)


@triton.jit
def _columns_kernel(
    q_ptr, k_ptr, valid_ptr, lse_ptr, weights_ptr, columns_ptr,
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
    block = tl.program_id(0)
    b = tl.program_id(1) // kv_heads
    kv = tl.program_id(1) % kv_heads
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < length
    d = tl.arange(0, dim)
    k = tl.load(
        k_ptr + b * stride_kb + kv * stride_kh + cols[:, None] * stride_kt + d[None, :], mask=col_in[:, None]
    ).to(tl.float32)
    col_ok = tl.load(valid_ptr + b * stride_validb + cols, mask=col_in, other=0) != 0
    column = tl.zeros((BLOCK_N,), tl.float32)
    first_row = (block * BLOCK_N) // BLOCK_M * BLOCK_M  # earlier rows cannot see these keys
    for g in range(group):
        head = kv * group + g
        for start in range(first_row, length, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < length
            q_ptrs = q_ptr + b * stride_qb + head * stride_qh + rows[:, None] * stride_qt + d[None, :]
            q = tl.load(q_ptrs, mask=row_ok[:, None]).to(tl.float32)
            lse = tl.load(lse_ptr + b * stride_lb + head * stride_lh + rows, mask=row_ok, other=0.0)
            weight = tl.load(weights_ptr + b * stride_wb + rows, mask=row_ok, other=0.0)
            logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
            seen = _visible(rows, cols, col_ok, length) & row_ok[:, None]
            p = tl.where(seen, tl.exp(logits - lse[:, None]), 0.0)
            column += tl.sum(p * weight[:, None], axis=0)
    tl.store(columns_ptr + b * stride_cb + kv * stride_ch + cols, column, mask=col_in)


def column_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
    block_rows: int = 64,
    block_cols: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels with :func:`~h2o_eval.kernels.reference.column_scores_reference`'s contract."""
    batch, q_heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    valid = valid.to(torch.int8).contiguous()
    weights = weights.float().contiguous()
    output = torch.empty_like(query)
    lse = torch.empty(batch, q_heads, length, dtype=torch.float32, device=query.device)
    columns = torch.empty(batch, kv_heads, length, dtype=torch.float32, device=query.device)
    _rows_kernel[(triton.cdiv(length, block_rows), batch * q_heads)](
        query, key, value, valid, output, lse,
        length, scaling,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        valid.stride(0),
        output.stride(0), output.stride(1), output.stride(2),
        lse.stride(0), lse.stride(1),
        q_heads=q_heads, group=group, dim=dim, BLOCK_M=block_rows, BLOCK_N=block_cols,
        PRECISION=dot_precision(query.dtype),
    )  # fmt: skip
    _columns_kernel[(triton.cdiv(length, block_cols), batch * kv_heads)](
        query, key, valid, lse, weights, columns,
        length, scaling,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        valid.stride(0),
        lse.stride(0), lse.stride(1),
        weights.stride(0),
        columns.stride(0), columns.stride(1),
        kv_heads=kv_heads, group=group, dim=dim, BLOCK_M=block_rows, BLOCK_N=block_cols,
        PRECISION=dot_precision(query.dtype),
    )  # fmt: skip
    return output, columns
