"""PyTorch references of the Triton kernels beside this file; also the CPU path, so they import no Triton.

The third kernel, ``eviction_scan``, has the mechanism's own definition as its reference:
:func:`h2o_eval.eviction.attend_chunk_reference`.
"""

from __future__ import annotations

import torch


def grouped_logits(
    query: torch.Tensor, key: torch.Tensor, scaling: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """query [B, Hq, n, D] against key [B, Hkv, N, D]: [B, Hkv, G, n, N] float32 logits, without copying K per
    query head (query head h*G+g reads KV head h). ``out``: a flat float32 buffer of at least B * Hq * n * N
    elements to write them to (on the CPU a fresh tensor that large costs its page faults on every call); unused
    while autograd records query or key, as matmul's ``out=`` has no gradient."""
    batch, q_heads, n, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    grouped = query.float().reshape(batch, kv_heads, q_heads // kv_heads * n, dim)
    if out is not None and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        out = None
    if out is not None:
        out = out[: batch * q_heads * n * slots].view(batch, kv_heads, q_heads // kv_heads * n, slots)
    logits = torch.matmul(grouped, key.float().transpose(-1, -2), out=out).mul_(scaling)
    return logits.view(batch, kv_heads, q_heads // kv_heads, n, -1)


def grouped_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """probs [B, Hkv, G, n, N] @ value [B, Hkv, N, D] -> [B, Hq, n, D] float32, without copying V per group."""
    batch, kv_heads, group, n, slots = probs.shape
    out = torch.matmul(probs.reshape(batch, kv_heads, group * n, slots), value.float())
    return out.view(batch, kv_heads * group, n, -1)


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
    block: int = 128,
    output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Causal attention over a whole prompt and each key's weighted column sum of its probabilities.

    query [B, Hq, T, D]; key, value [B, Hkv, T, D] (Hq = G * Hkv, query head h*G+g reads KV head h);
    valid [B, T] bool (False: padding); weights [B, T] float, one per query row.
    Returns the output [B, Hq, T, D] in the query's dtype and columns [B, Hkv, T] float32, where
    columns[b, h, j] = sum_i weights[b, i] * sum_g P[b, h*G+g, i, j].

    Rows go ``block`` at a time against the keys up to the block's last row, so the T x T matrix never exists
    whole: a block's probabilities give both its output and its share of the columns. The block is computed one
    (sequence, KV head) at a time, in one reused buffer, so that its probabilities stay in the CPU's cache
    between the passes over them (1.3x faster at 8k than all heads at once in fresh tensors, same numbers).
    Rows before the first that carries a weight (all but SnapKV's window, say) take PyTorch's fused attention
    instead. Without ``output`` only the columns are computed (output None), and those rows cost nothing.

    Also the CPU path of :func:`~h2o_eval.kernels.prompt.prompt_votes`: on a CPU the logits are the cost, and one
    pass computes each once, where torch's fused attention and then a column pass compute them twice
    (1.7-2.2x this function's time for H2O at 2k tokens on this project's CPUs).
    """
    length = query.shape[2]
    kv_heads = key.shape[1]
    group = query.shape[1] // kv_heads
    padded = not bool(valid.all())
    cols = torch.arange(length, device=query.device)
    attention = torch.empty_like(query) if output else None
    columns = torch.zeros(key.shape[:3], dtype=torch.float32, device=query.device)
    voting = (weights != 0).any(0).nonzero()
    first = int(voting[0]) if len(voting) else length
    if attention is not None and first > 0:
        attention[:, :, :first] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, :first].float(),
            key[:, :, :first].float(),
            value[:, :, :first].float(),
            attn_mask=visible(valid, cols[:first], cols[:first]).unsqueeze(1) if padded else None,
            is_causal=not padded,
            scale=scaling,
            enable_gqa=True,
        ).to(query.dtype)
    # Each (sequence, KV head) alone, so that a block's logits stay in the cache between the passes over them, in
    # one buffer as large as the last block needs (a fresh one per block would cost its page faults each time).
    buffer = torch.empty(group * min(block, length - first) * length, dtype=torch.float32, device=query.device)
    for start in range(first, length, block):
        stop = min(start + block, length)
        ahead = (
            None if padded else torch.ones(stop - start, stop - start, dtype=torch.bool, device=query.device).triu_(1)
        )
        for b in range(query.shape[0]):
            seen = visible(valid[b : b + 1], cols[start:stop], cols[:stop]) if padded else None
            row_weights = weights[b, start:stop].float().repeat(group).view(1, 1, 1, -1)
            for h in range(kv_heads):
                heads = slice(h * group, (h + 1) * group)
                q, k, v = query[b : b + 1, heads, start:stop], key[b : b + 1, h : h + 1, :stop], value[b, h, :stop]
                logits = grouped_logits(q, k, scaling, out=buffer)
                if padded:
                    logits.masked_fill_(~seen, -torch.inf)
                else:  # only the block's own square has keys after a row
                    logits[..., start:stop].masked_fill_(ahead, -torch.inf)
                probs = logits.softmax(-1) if logits.requires_grad else torch.softmax(logits, dim=-1, out=logits)
                if attention is not None:
                    attention[b, heads, start:stop] = grouped_values(probs, v.view(1, 1, stop, -1))[0].to(query.dtype)
                summed = torch.matmul(row_weights, probs.view(1, 1, -1, stop))
                columns[b, h, :stop] += summed.view(stop)
    return attention, columns


def first_voters(weights: torch.Tensor) -> torch.Tensor:
    """[B] int64: each sequence's first row with a nonzero weight (weights [B, T]), T where no row votes. The
    column pass starts there: earlier rows carry no vote. Computed on the device, without reading values."""
    rows = torch.arange(weights.shape[-1], device=weights.device)
    return torch.where(weights != 0, rows, weights.shape[-1]).amin(-1)


def attention_lse_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    start: torch.Tensor | None = None,
    block: int = 128,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Causal attention over a prompt and each row's log-sum-exp, ``block`` rows at a time (no T x T matrix).

    query [B, Hq, T, D]; key, value [B, Hkv, T, D] (query head h*G+g reads KV head h); valid [B, T] bool, a
    padding key seen only from its own row (:func:`visible`). Returns the output [B, Hq, T, D] in the query's
    dtype and lse [B, Hq, T] float32, lse[b, h, i] = log sum_j exp(scaling * q[b, h, i] . k[b, h // G, j]) over
    the keys j row i sees (natural log, as torch's fused attention kernels return it). ``start`` [B] int64: only
    the rows from start[b] on are computed, without the output (None; earlier rows' lse NaN): the log-sum-exp of
    the rows that vote, when the caller has the output already. One (sequence, KV head) at a time in one reused
    buffer, as :func:`column_scores_reference`. The reference of the Triton
    :func:`~h2o_eval.kernels.column_scores.attention_lse`.
    """
    batch, q_heads, length, _ = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    cols = torch.arange(length, device=query.device)
    attention = torch.zeros_like(query) if start is None else None
    lse = torch.full(query.shape[:3], float("nan"), dtype=torch.float32, device=query.device)
    buffer = torch.empty(group * min(block, length) * length, dtype=torch.float32, device=query.device)
    for b, first_row in enumerate([0] * batch if start is None else start.tolist()):
        for first in range(first_row, length, block):
            stop = min(first + block, length)
            hidden = ~visible(valid[b : b + 1], cols[first:stop], cols[:stop])
            for h in range(kv_heads):
                heads = slice(h * group, (h + 1) * group)
                q, k = query[b : b + 1, heads, first:stop], key[b : b + 1, h : h + 1, :stop]
                probs = _masked_softmax_(grouped_logits(q, k, scaling, out=buffer), hidden, lse[b, heads, first:stop])
                if attention is not None:
                    values = grouped_values(probs, value[b : b + 1, h : h + 1, :stop])
                    attention[b, heads, first:stop] = values[0].to(query.dtype)
    return attention, lse


def _masked_softmax_(logits: torch.Tensor, hidden: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``logits`` where not ``hidden``, in place (out of place while autograd records
    them); writes each row's log-sum-exp into ``lse``."""
    if logits.requires_grad:
        logits = logits.masked_fill(hidden, -torch.inf)
        lse.copy_(logits.logsumexp(-1).view(lse.shape))
        return logits.softmax(-1)
    top = logits.masked_fill_(hidden, -torch.inf).amax(-1, keepdim=True)
    total = logits.sub_(top).exp_().sum(-1, keepdim=True)
    lse.copy_((top + total.log()).view(lse.shape))
    return logits.div_(total)


def column_sums_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor,
    lse: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
    block: int = 128,
) -> torch.Tensor:
    """Each key's probabilities, weighted per row and summed over the rows that see it and the KV head's G query
    heads, from the rows' log-sum-exp: columns [B, Hkv, T] float32,
    columns[b, h, j] = sum_i weights[b, i] sum_g exp(scaling * q[b, h*G+g, i] . k[b, h, j] - lse[b, h*G+g, i]).

    query [B, Hq, T, D]; key [B, Hkv, T, D]; valid [B, T] bool (:func:`visible`); lse [B, Hq, T] float32 (as
    :func:`attention_lse_reference` gives it); weights [B, T]. ``block`` rows at a time, one (sequence, KV head)
    at a time in one reused buffer, from each sequence's first row with a nonzero weight (:func:`first_voters`):
    the rows before it cost nothing and their lse is never read (the later ones' must be finite). With the lse of
    the same attention, this equals :func:`column_scores_reference`'s columns. The reference of the Triton
    :func:`~h2o_eval.kernels.column_scores.column_sums`.
    """
    batch, q_heads, length, _ = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    cols = torch.arange(length, device=query.device)
    columns = torch.zeros(key.shape[:3], dtype=torch.float32, device=query.device)
    buffer = torch.empty(group * min(block, length) * length, dtype=torch.float32, device=query.device)
    for b, first_row in enumerate(first_voters(weights).tolist()):
        for first in range(first_row, length, block):
            stop = min(first + block, length)
            hidden = ~visible(valid[b : b + 1], cols[first:stop], cols[:stop])
            row_weights = weights[b, first:stop].float().repeat(group).view(1, -1)
            for h in range(kv_heads):
                heads = slice(h * group, (h + 1) * group)
                q, k = query[b : b + 1, heads, first:stop], key[b : b + 1, h : h + 1, :stop]
                logits = grouped_logits(q, k, scaling, out=buffer)[0, 0]
                row_lse = lse[b, heads, first:stop, None]
                if logits.requires_grad:
                    probs = torch.exp(logits - row_lse).masked_fill(hidden, 0.0)
                else:
                    probs = logits.sub_(row_lse).exp_().masked_fill_(hidden, 0.0)
                columns[b, h, :stop] += torch.matmul(row_weights, probs.view(-1, stop)).view(stop)
    return columns


# The constants the decode attention reads, made once per value and device and kept for good: a decode step captured
# as a CUDA graph reads them by address (h2o_eval.graphs).
CONSTANTS: dict[tuple, torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A float32 scalar on ``device``, made once: ``torch.where`` with a Python number would make it every call."""
    key = ("scalar", value, str(device))
    if key not in CONSTANTS:
        CONSTANTS[key] = torch.tensor(value, device=device)
    return CONSTANTS[key]


def _ones(count: int, device: torch.device) -> torch.Tensor:
    key = ("ones", count, str(device))
    if key not in CONSTANTS:
        CONSTANTS[key] = torch.ones(1, 1, count, device=device)
    return CONSTANTS[key]


def decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: torch.Tensor,
    scores: torch.Tensor,
    scaling: float,
    replace: bool = False,
    layer: bool = False,
) -> torch.Tensor:
    """One query per sequence [B, Hq, D] against the held slots of keys/values [B, Hkv, S, D] (held [B, Hkv, S]).

    Softmax over the held slots of each KV head for its G query heads; adds the probabilities, summed over
    the group, into ``scores`` [B, Hkv, S] float32. Returns the output [B, Hq, D] in the query's dtype.
    ``replace``: the held slots' scores become those sums instead (unheld ones keep theirs); ``layer``: every KV
    head gets the sum over all the layer's query heads. Five torch operations for H2O's rule, six for the others:
    on a GPU each is a kernel launch, and a decode step's launches set its pace at batch 1 (so the sums over query
    heads are products with ones, which add them in another order than ``sum``: equal within float rounding).
    """
    batch, q_heads, dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    grouped = query.float().reshape(batch * kv_heads, group, dim)
    key_rows = keys.float().reshape(batch * kv_heads, slots, dim).transpose(1, 2)
    logits = torch.baddbmm(_constant(0.0, query.device), grouped, key_rows, beta=0, alpha=scaling)
    held_rows = held.reshape(batch * kv_heads, 1, slots)
    probs = torch.where(held_rows, logits, _constant(-torch.inf, query.device)).softmax(-1)
    if layer:  # the sum over every query head of the layer, as a product with ones: one operation
        votes = torch.bmm(_ones(q_heads, query.device).expand(batch, 1, q_heads), probs.view(batch, q_heads, slots))
        if replace:
            torch.where(held, votes, scores, out=scores)
        else:
            scores.add_(votes)
    elif replace:
        torch.where(held, probs.sum(1).view(batch, kv_heads, slots), scores, out=scores)
    else:
        ones = _ones(group, query.device).expand(batch * kv_heads, 1, group)
        scores.view(batch * kv_heads, 1, slots).baddbmm_(ones, probs)
    output = torch.bmm(probs, values.float().reshape(batch * kv_heads, slots, dim))
    return output.view(batch, q_heads, dim).to(query.dtype)
