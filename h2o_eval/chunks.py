"""A chunk of any length, fast: the same contract as the definition
(:func:`h2o_eval.eviction.attend_chunk_reference`). The prompt phase is fused attention plus one pass of column sums
(``prompt_votes``, Triton on CUDA), then :func:`~h2o_eval.compression.compress`; the decode phase is the
numba-compiled row scan over blocks of rows (the Triton ``eviction_scan`` on CUDA), or plain masked attention when no
row can evict and none votes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from h2o_eval.compression import compress
from h2o_eval.eviction import Chunk, Result, prompt_rows, share_votes
from h2o_eval.kernels.numba_scan import scan_rows
from h2o_eval.kernels.prompt import prompt_votes
from h2o_eval.kernels.reference import grouped_logits, grouped_values, visible
from h2o_eval.policies.base import Combine, DecodeVote, Heads

ROW_BLOCK = 256  # decode-phase rows per block on the CPU: memory grows as rows x slots, never n x N


@dataclass(frozen=True)
class Kernels:
    """The kernels a chunk runs on, chosen in :mod:`h2o_eval.implementation`: ``votes`` (the prompt's attention and
    column sums, :func:`~h2o_eval.kernels.prompt.prompt_votes`'s contract) and ``scan`` (the decode phase of a rule
    scored per KV head, :func:`scan_triton`'s contract; None: the numba scan over blocks of rows)."""

    votes: Callable = prompt_votes
    scan: Callable | None = None


def attend_chunk(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: Chunk, kernels: Kernels = Kernels()
) -> Result:
    """Same contract as :func:`attend_chunk_reference`, fast: the prompt phase from ``kernels.votes``,
    :func:`compress`, then the decode phase through the row scan (``kernels.scan``, else the numba scan over blocks
    of rows), or as plain masked attention when no decode row can evict and none votes."""
    n, slots = query.shape[2], key.shape[2]
    in_prompt = prompt_rows(chunk, n)
    held, scores, capacity = chunk.held, chunk.scores.float(), chunk.capacity
    output = kept = None
    if bool(in_prompt.any()):
        if slots != n:
            raise ValueError("prompt rows need an empty cache: prefill a chunk before any other")
        output, held, scores, capacity = _prompt_phase(query, key, value, chunk, in_prompt, kernels.votes)
        kept = torch.where(in_prompt.any(-1, keepdim=True), held.sum(-1), 0)
    decoding = chunk.arriving & ~in_prompt
    if not bool(decoding.any()):
        return Result(output, held, scores, capacity, kept)
    rest = replace(chunk, held=held, scores=scores, capacity=capacity, arriving=decoding)
    if rest.rule.decode_votes == DecodeVote.NONE and bool(
        (held.sum(-1) + decoding.sum(-1, keepdim=True) <= capacity).all()
    ):
        result = _attend_without_eviction(query, key, value, rest)
    elif kernels.scan is not None and rest.rule.heads == Heads.KV:  # the Triton scan runs each KV head alone
        result = kernels.scan(query, key, value, rest)
    else:
        result = _scan_cpu(query, key, value, rest)
    if output is not None:
        result.output = torch.where(in_prompt.view(in_prompt.shape[0], 1, n, 1), output, result.output)
    elif not chunk.output:  # the caller computes the prompt rows' attention
        result.output.masked_fill_(in_prompt.view(in_prompt.shape[0], 1, n, 1), 0)
    result.kept = kept
    return result


def _prompt_phase(query, key, value, chunk: Chunk, in_prompt: torch.Tensor, votes: Callable):
    """Prompt rows attend causally in full; their votes feed the scores; the cache is then compressed."""
    rule = chunk.rule
    last = int(chunk.prefill.clamp(max=query.shape[2]).max())
    q, k, v, rows = query[:, :, :last], key[:, :, :last], value[:, :, :last], in_prompt[:, :last]
    weights = rule.prompt_weights(rows)
    scores = chunk.scores.float().clone()
    if weights is None:
        # Without padding this is plain causal attention: SDPA's causal kernel (the same numbers, at 4k half the
        # time of the masked one).
        causal = bool(rows.all())
        cols = torch.arange(last, device=q.device)
        seen = None if causal else visible(rows, cols, cols).unsqueeze(1)
        output = (
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=seen, is_causal=causal, scale=chunk.scaling, enable_gqa=True
            )
            if chunk.output
            else None
        )
    else:
        shared = chunk.votes if not chunk.output else None
        known = [a for w, r, a in shared or () if torch.equal(w, weights) and torch.equal(r, rows)]
        if known:
            output, attention = None, known[0]
        else:
            output, attention = votes(q, k, v, rows, weights, chunk.scaling, chunk.output)
        if shared is not None and not known:
            shared.append((weights, rows, attention))
        attention = share_votes(attention, rule)
        if rule.combine == Combine.REPLACE:
            scores[..., :last] = torch.where(rows.unsqueeze(1), attention, scores[..., :last])
        else:
            scores[..., :last] += attention
    if output is not None and last < query.shape[2]:  # rows past the last prompt row: zero until decoded
        output = torch.cat([output, output.new_zeros(*output.shape[:2], query.shape[2] - last, output.shape[-1])], 2)
    held = chunk.held.clone()
    held[..., :last] |= rows.unsqueeze(1)
    now = torch.where(rows.any(-1), chunk.position[:, 0].masked_fill(~in_prompt, -1).amax(-1), -1)
    held, scores, capacity = compress(
        held, scores, chunk.position, chunk.capacity, chunk.recent, chunk.sinks, now, rule, chunk.rescore
    )
    return output, held, scores, capacity


def _attend_without_eviction(query, key, value, chunk: Chunk) -> Result:
    """Decode rows that can evict nothing and vote nothing: each sees the held slots and the arriving tokens
    up to itself (a padding row sees itself), blocks of rows at a time from the first arriving row, as in
    :func:`_scan_cpu` (the rows before it are the prompt's, whose output :func:`attend_chunk` keeps)."""
    n, slots = query.shape[2], key.shape[2]
    state = slots - n
    held = chunk.held.clone()
    held[..., state:] |= chunk.arriving.unsqueeze(1)
    output = torch.zeros_like(query)
    cols = torch.arange(slots, device=query.device)
    first = int(chunk.arriving.any(0).int().argmax())
    for start in range(first, n, ROW_BLOCK):
        stop = min(start + ROW_BLOCK, n)
        rows = torch.arange(start, stop, device=query.device)
        own = cols.view(1, -1) == (state + rows).view(-1, 1)
        causal = cols.view(1, -1) <= (state + rows).view(-1, 1)
        seen = (held.unsqueeze(2) & causal) | own  # [B, Hkv, rows, N]; state slots all precede the rows
        logits = grouped_logits(query[:, :, start:stop], key, chunk.scaling)
        probs = torch.softmax(logits.masked_fill(~seen.unsqueeze(2), float("-inf")), dim=-1)
        output[:, :, start:stop] = grouped_values(probs, value).to(query.dtype)
    return Result(output, held, chunk.scores, chunk.capacity)


def _scan_cpu(query, key, value, chunk: Chunk) -> Result:
    """The decode phase on the CPU: per block of rows, the block's logits, the numba scan over them, then one
    masked softmax for the block's outputs.

    A block's rows can only see the slots held when it starts and its own tokens (an evicted token never
    returns), so its logits are computed against those live slots alone (the scan reads them through
    ``column``): under a budget of C the block costs rows x (C + rows), not rows x every slot before it.

    With ``heads="layer"`` the KV heads hold one set of tokens, so the scan walks it once, as one head whose
    group is every query head of the layer (each against its own KV head's logits), and every head gets the
    result."""
    batch, n = query.shape[0], query.shape[2]
    kv_heads, slots = key.shape[1], key.shape[2]
    state = slots - n
    sets = 1 if chunk.rule.heads == Heads.LAYER else kv_heads
    layout = [chunk.held, chunk.position, chunk.scores, chunk.capacity]
    if sets == 1 and not all(torch.equal(t, t[:, :1].expand_as(t)) for t in layout):
        raise RuntimeError("heads=layer needs the KV heads of a layer to hold the same tokens with the same scores")
    held = chunk.held[:, :sets].cpu().numpy().copy()
    scores = chunk.scores[:, :sets].detach().float().cpu().numpy().copy()
    enter = np.where(held, 0, n).astype(np.int64)
    leave = np.full(held.shape, n, dtype=np.int64)
    stuck = np.zeros(held.shape[:2], dtype=np.bool_)
    arriving = chunk.arriving.cpu().numpy()
    column = np.zeros(held.shape, dtype=np.int64)
    args = (
        held,
        arriving,
        chunk.position[:, :sets].contiguous().cpu().numpy(),
        scores,
        chunk.capacity[:, :sets].contiguous().cpu().numpy(),
        chunk.recent.cpu().numpy(),
        chunk.sinks.cpu().numpy(),
        int(chunk.rule.decode_votes),
        enter,
        leave,
        stuck,
        column,
    )
    output = torch.zeros_like(query)
    first = int(np.argmax(arriving.any(0)))
    device = query.device
    buffer = torch.empty(0, dtype=torch.float32, device=device)
    for start in range(first, n, ROW_BLOCK):
        stop = min(start + ROW_BLOCK, n)
        live = torch.from_numpy(held[..., : state + stop].copy())
        live[..., state + start :] = True
        width = int(live.sum(-1).max())
        if width < state + stop:  # the live slots first, in slot order, then others (masked) up to the widest
            index = torch.argsort((~live).to(torch.int8), dim=-1, stable=True)[..., :width]
            gather = index.to(device).expand(batch, kv_heads, width).unsqueeze(-1).expand(-1, -1, -1, key.shape[-1])
            live_keys, live_values = key.gather(2, gather), value.gather(2, gather)
        else:
            index = torch.arange(width, device="cpu").expand(batch, sets, width)  # numpy indices for the scan
            live_keys, live_values = key[:, :, :width], value[:, :, :width]
        index = index.numpy()
        np.put_along_axis(column, index, np.arange(width), axis=-1)
        if buffer.numel() < query.shape[1] * batch * (stop - start) * width:
            buffer = torch.empty(query.shape[1] * batch * ROW_BLOCK * width, dtype=torch.float32, device=device)
        logits = grouped_logits(query[:, :, start:stop], live_keys, chunk.scaling, out=buffer)
        scan_rows(logits.detach().cpu().numpy().reshape(batch, sets, -1, stop - start, width), start, *args)
        if stuck.any():
            raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")
        rows = torch.arange(start, stop, device=device).view(1, 1, -1, 1)
        enter_t = torch.from_numpy(np.take_along_axis(enter, index, -1)).to(device).unsqueeze(2)
        leave_t = torch.from_numpy(np.take_along_axis(leave, index, -1)).to(device).unsqueeze(2)
        seen = (rows >= enter_t) & (rows < leave_t)
        # A padding row sees only itself, so its (unused) output stays finite.
        own = torch.from_numpy(index).to(device).unsqueeze(2) == (state + rows)
        seen = seen | (~chunk.arriving[:, start:stop].view(batch, 1, -1, 1) & own)
        logits.masked_fill_(~seen.unsqueeze(2), float("-inf"))
        probs = logits.softmax(-1) if logits.requires_grad else torch.softmax(logits, dim=-1, out=logits)
        output[:, :, start:stop] = grouped_values(probs, live_values).to(query.dtype)
    held_t, scores_t = (torch.from_numpy(a).to(device).expand(batch, kv_heads, -1).contiguous() for a in (held, scores))
    return Result(output, held_t, scores_t, chunk.capacity)


def scan_triton(query, key, value, chunk: Chunk) -> Result:
    """The decode phase of a chunk through the Triton ``eviction_scan``, each KV head alone."""
    from h2o_eval.kernels.eviction_scan import eviction_scan

    output, held, scores = eviction_scan(
        query,
        key,
        value,
        chunk.held,
        chunk.arriving,
        chunk.position,
        chunk.scores,
        chunk.capacity,
        chunk.recent,
        chunk.sinks,
        int(chunk.rule.decode_votes),
        chunk.scaling,
    )
    return Result(output, held, scores, chunk.capacity)
