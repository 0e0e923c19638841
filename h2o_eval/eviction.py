"""The one eviction mechanism: a chunk of new tokens attends to (cache state + itself) under per-step eviction.

Shapes: B sequences, Hq query heads over Hkv KV heads (G = Hq / Hkv per group, query head h*G+g belongs to KV
head h), n new tokens, N = S + n slots (S state slots followed by the n new tokens), D head dim.

For each (sequence, KV head), row r of the chunk (token t = ``position`` of slot S + r) does, in order:

1. if the cache already holds C tokens (and row r is past the prefill rows), evict the held token that is
   neither among the ``recent`` most recent (positions > t - recent, the current token counting as the newest)
   nor among the first ``sinks``, with the lowest score; ties go to the smallest position. It never returns;
2. the token enters the cache, and its queries attend to exactly the held tokens (softmax renormalised over them);
3. scores take that attention, summed over the group's query heads: added (``accumulate``), or replacing the
   previous ones (``current``); ``random`` scores are fixed per position, ``none`` leaves recency to decide;
4. after the last (real) prefill row, the cache is compressed to C by the same rule (lowest scores out).

Padding tokens (``arriving`` False) never enter. Simulate = empty state + the whole sequence; prefill = all
context rows as prefill rows; decode = chunks of one token. :func:`attend_chunk_reference` states this as a
plain loop over rows; :func:`attend_chunk` is the fast path: on the CPU one batched matmul for the logits, the
sequential scan compiled with numba over (sequence, KV head), then one masked softmax for the outputs; on CUDA
the Triton kernels of ``h2o_eval.kernels`` (:func:`attend_chunk_triton`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from h2o_eval.kernels.reference import (
    column_scores_reference,
    decode_attention_reference,
    grouped_logits,
    grouped_values,
    visible,
)
from h2o_eval.policies import ScoreRule

_RULE_CODE = {ScoreRule.ACCUMULATE: 0, ScoreRule.CURRENT: 1, ScoreRule.RANDOM: 2, ScoreRule.NONE: 3}


@dataclass
class Chunk:
    """Everything but q/k/v that one chunk's attention needs.

    held: [B, Hkv, N] bool, state slots held at the start (new slots False).
    arriving: [B, n] bool, new tokens that are real (False for padding).
    position: [B, Hkv, N] int64, each slot's token index in its sequence (padding excluded).
    scores: [B, Hkv, N] float32, the state slots' scores (new slots 0; for ``random``, every slot's score).
    capacity, recent, sinks, prefill: [B] int64; ``prefill`` rows attend without eviction, then compress.
    """

    held: torch.Tensor
    arriving: torch.Tensor
    position: torch.Tensor
    scores: torch.Tensor
    capacity: torch.Tensor
    recent: torch.Tensor
    sinks: torch.Tensor
    prefill: torch.Tensor
    rule: ScoreRule
    scaling: float


def random_scores(seed: int, layer: int, position: torch.Tensor) -> torch.Tensor:
    """A uniform [0, 1) score per (seed, layer, KV head, position): the same on every path and step."""
    heads = torch.arange(position.shape[1], device=position.device).view(1, -1, 1)
    x = (position * 1_000_003 + heads * 7_919 + layer * 104_729 + seed * 15_485_863) & 0x7FFFFFFF
    for _ in range(3):  # a few rounds of an integer hash (xorshift-multiply), all in int64
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
        x = ((x ^ (x >> 12)) * 0x297A2D39) & 0x7FFFFFFF
    return (x & 0xFFFFFF).to(torch.float32) / float(1 << 24)


def _compress_rows(chunk: Chunk, n: int) -> torch.Tensor:
    """[B] the row after which each sequence's cache is compressed: its last real row among the prefill rows
    (-1: none)."""
    rows = torch.arange(1, n + 1, device=chunk.arriving.device)
    eligible = chunk.arriving & (rows <= chunk.prefill.view(-1, 1))
    return (eligible * rows).amax(-1) - 1


def _lowest(scores: torch.Tensor, position: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Index of the candidate with the lowest score, the smallest position among equal scores."""
    best = scores.masked_fill(~candidate, float("inf")).amin(-1, keepdim=True)
    tied = candidate & (scores == best)
    return position.masked_fill(~tied, torch.iinfo(torch.int64).max).argmin(-1)


def attend_chunk_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: Chunk
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The semantics above as a loop over rows. Returns (output [B, Hq, n, D], held [B, Hkv, N], scores)."""
    batch, q_heads, n, _ = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    state = slots - n
    logits = grouped_logits(query, key, chunk.scaling)
    held = chunk.held.clone()
    scores = chunk.scores.clone().float()
    position = chunk.position
    output = torch.zeros(batch, kv_heads, group, n, value.shape[-1], dtype=torch.float32, device=query.device)
    capacity, recent, sinks = (x.view(-1, 1, 1) for x in (chunk.capacity, chunk.recent, chunk.sinks))
    compress_at = _compress_rows(chunk, n)

    def evict_one(where: torch.Tensor, now: torch.Tensor) -> None:
        protected = (position > now.unsqueeze(-1) - recent) | (position < sinks)
        candidate = held & ~protected
        if bool((where & ~candidate.any(-1)).any()):
            raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")
        victim = _lowest(scores, position, candidate)
        held.scatter_(-1, victim.unsqueeze(-1), held.gather(-1, victim.unsqueeze(-1)) & ~where.unsqueeze(-1))

    for row in range(n):
        slot = state + row
        arrives = chunk.arriving[:, row].view(-1, 1).expand(batch, kv_heads)
        now = position[..., slot]
        past_prefill = (row >= chunk.prefill).view(-1, 1)
        evict_one(arrives & past_prefill & (held.sum(-1) >= capacity[..., 0]), now)
        held[..., slot] |= arrives
        masked = logits[:, :, :, row].masked_fill(~held.unsqueeze(2), float("-inf"))
        probs = torch.softmax(masked, dim=-1).nan_to_num(0.0) * arrives.view(batch, kv_heads, 1, 1)
        output[:, :, :, row] = torch.matmul(probs, value.float())
        attention = probs.sum(2)
        if chunk.rule is ScoreRule.ACCUMULATE:
            scores += attention
        elif chunk.rule is ScoreRule.CURRENT:
            scores = torch.where(arrives.unsqueeze(-1), attention, scores)
        compress = arrives & (row == compress_at).view(-1, 1)
        while bool((compress & (held.sum(-1) > capacity[..., 0])).any()):
            evict_one(compress & (held.sum(-1) > capacity[..., 0]), now)
    return output.view(batch, q_heads, n, -1).to(query.dtype), held, scores


def attend_chunk(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: Chunk
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`attend_chunk_reference`: on CUDA the Triton kernels (:func:`attend_chunk_triton`),
    elsewhere the row scan compiled with numba.

    A chunk that is all prefill from an empty cache (a prompt) takes :func:`_prefill_chunk` instead.
    """
    if query.is_cuda:
        return attend_chunk_triton(query, key, value, chunk)
    batch, q_heads, n, _ = query.shape
    slots = key.shape[2]
    if _is_prompt(chunk, n, slots):
        return _prefill_chunk(query, key, value, chunk)
    logits = grouped_logits(query, key, chunk.scaling)
    held = chunk.held.cpu().numpy().copy()
    scores = chunk.scores.detach().float().cpu().numpy().copy()
    enter = np.where(held, 0, n).astype(np.int64)
    leave = np.full(held.shape, n, dtype=np.int64)
    stuck = np.zeros(held.shape[:2], dtype=np.bool_)
    _scan(
        logits.detach().cpu().numpy(),
        held,
        chunk.arriving.cpu().numpy(),
        chunk.position.cpu().numpy(),
        scores,
        chunk.capacity.cpu().numpy(),
        chunk.recent.cpu().numpy(),
        chunk.sinks.cpu().numpy(),
        chunk.prefill.cpu().numpy(),
        _compress_rows(chunk, n).cpu().numpy(),
        _RULE_CODE[chunk.rule],
        enter,
        leave,
        stuck,
    )
    if stuck.any():
        raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")
    device = query.device
    rows = torch.arange(n, device=device).view(1, 1, n, 1)
    enter_t, leave_t = torch.from_numpy(enter).to(device), torch.from_numpy(leave).to(device)
    visible = (rows >= enter_t.unsqueeze(2)) & (rows < leave_t.unsqueeze(2))
    # A padding row sees only itself, so its (unused) output stays finite.
    padding_rows = ~chunk.arriving.view(batch, 1, n, 1)
    own_slot = torch.arange(slots, device=device).view(1, 1, 1, slots) == (slots - n + rows)
    visible = visible | (padding_rows & own_slot)
    probs = torch.softmax(logits.masked_fill(~visible.unsqueeze(2), float("-inf")), dim=-1)
    output = grouped_values(probs, value)
    return (
        output.to(query.dtype),
        torch.from_numpy(held).to(device),
        torch.from_numpy(scores).to(device),
    )


def attend_chunk_triton(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: Chunk
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`attend_chunk_reference`, on the Triton kernels of ``h2o_eval.kernels``: a prompt
    (all prefill, empty cache) through ``column_scores``, any other chunk through ``eviction_scan``."""
    if _is_prompt(chunk, query.shape[2], key.shape[2]):
        return _prefill_chunk(query, key, value, chunk, triton=True)
    from h2o_eval.kernels.eviction_scan import eviction_scan

    return eviction_scan(
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
        chunk.prefill,
        _compress_rows(chunk, query.shape[2]),
        _RULE_CODE[chunk.rule],
        chunk.scaling,
    )


def _is_prompt(chunk: Chunk, n: int, slots: int) -> bool:
    """All rows are prefill rows and the cache starts empty."""
    return slots == n and bool((chunk.prefill >= n).all())


def _prefill_chunk(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: Chunk, triton: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole chunk of prefill rows from an empty cache: causal attention with the score rule applied to its
    probabilities (column sums for ``accumulate``, the last row for ``current``; SDPA alone when no score needs
    them), from ``column_scores`` (Triton) or its PyTorch reference, then compression to C: the lowest
    (score, position) unprotected tokens go."""
    batch, _, n, _ = query.shape
    device = query.device
    arriving = chunk.arriving
    if chunk.rule not in (ScoreRule.ACCUMULATE, ScoreRule.CURRENT):
        seen = visible(arriving, torch.arange(n, device=device), torch.arange(n, device=device))
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=seen.unsqueeze(1), scale=chunk.scaling, enable_gqa=True
        )
        scores = chunk.scores.clone().float()
    else:  # the probabilities are needed anyway: one pass gives the outputs and the scores
        last = (arriving.cumsum(-1) == arriving.sum(-1, keepdim=True)) & arriving  # each sequence's last row
        weights = (arriving if chunk.rule is ScoreRule.ACCUMULATE else last).float()
        if triton:
            from h2o_eval.kernels.column_scores import column_scores

            output, attention = column_scores(query, key, value, arriving, weights, chunk.scaling)
        else:
            output, attention = column_scores_reference(query, key, value, arriving, weights, chunk.scaling)
        scores = chunk.scores.float() + attention if chunk.rule is ScoreRule.ACCUMULATE else attention
    held = arriving.unsqueeze(1).expand_as(scores).clone()
    now = (arriving.sum(-1) - 1).view(-1, 1, 1)
    protected = (chunk.position > now - chunk.recent.view(-1, 1, 1)) | (chunk.position < chunk.sinks.view(-1, 1, 1))
    candidate = held & ~protected
    excess = (held.sum(-1) - chunk.capacity.view(-1, 1)).clamp(min=0)
    order = torch.argsort(chunk.position, dim=-1, stable=True)
    order = order.gather(
        -1, torch.argsort(scores.masked_fill(~candidate, torch.inf).gather(-1, order), dim=-1, stable=True)
    )
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=device).expand_as(order))
    held &= ~(candidate & (rank < excess.unsqueeze(-1)))
    return output, held, scores


@numba.njit(cache=True, inline="always")
def _victim(slots, count, held_scores, positions, now, recent, sinks):
    best = -1
    for k in range(count):
        j = slots[k]
        pos = positions[j]
        if pos > now - recent or pos < sinks:
            continue
        if best < 0:
            best = k
            continue
        b = slots[best]
        if held_scores[j] < held_scores[b] or (held_scores[j] == held_scores[b] and pos < positions[b]):
            best = k
    return best


@numba.njit(cache=True, parallel=True)
def _scan(
    logits, held, arriving, position, scores, capacity, recent, sinks, prefill, compress_at, rule, enter, leave, stuck
):
    batch, kv_heads, group, n, num_slots = logits.shape
    state = num_slots - n
    for bh in numba.prange(batch * kv_heads):
        b = bh // kv_heads
        h = bh % kv_heads
        slots = np.empty(num_slots, dtype=np.int64)
        weights = np.empty(num_slots, dtype=np.float64)
        attention = np.empty(num_slots, dtype=np.float64)
        count = 0
        for j in range(num_slots):
            if held[b, h, j]:
                slots[count] = j
                count += 1
        for r in range(n):
            if not arriving[b, r]:
                continue
            now = position[b, h, state + r]
            if r >= prefill[b] and count >= capacity[b]:
                k = _victim(slots, count, scores[b, h], position[b, h], now, recent[b], sinks[b])
                if k < 0:
                    stuck[b, h] = True
                    break
                held[b, h, slots[k]] = False
                leave[b, h, slots[k]] = r
                count -= 1
                slots[k] = slots[count]
            slots[count] = state + r
            count += 1
            held[b, h, state + r] = True
            enter[b, h, state + r] = r
            if rule <= 1:
                for k in range(count):
                    attention[k] = 0.0
                for g in range(group):
                    top = -np.inf
                    for k in range(count):
                        top = max(top, logits[b, h, g, r, slots[k]])
                    total = 0.0
                    for k in range(count):
                        weights[k] = np.exp(logits[b, h, g, r, slots[k]] - top)
                        total += weights[k]
                    for k in range(count):
                        attention[k] += np.float32(weights[k] / total)
                for k in range(count):
                    if rule == 0:
                        scores[b, h, slots[k]] += np.float32(attention[k])
                    else:
                        scores[b, h, slots[k]] = np.float32(attention[k])
            if r == compress_at[b]:
                while count > capacity[b]:
                    k = _victim(slots, count, scores[b, h], position[b, h], now, recent[b], sinks[b])
                    if k < 0:
                        stuck[b, h] = True
                        break
                    held[b, h, slots[k]] = False
                    leave[b, h, slots[k]] = r + 1
                    count -= 1
                    slots[k] = slots[count]


def claim_slot(
    held: torch.Tensor,
    position: torch.Tensor,
    scores: torch.Tensor,
    now: torch.Tensor,
    capacity: torch.Tensor,
    recent: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor | None:
    """Step 1 of one arriving token per sequence, in place of a chunk: the slot [B, Hkv] it will occupy.

    A full cache gives up its victim (same rule as the scan); one below capacity takes a free slot. Returns
    None when some cache is below capacity with no free slot left (the caller grows the buffer instead).
    """
    count = held.sum(-1)
    full = count >= capacity.view(-1, 1)
    free = ~held
    if bool((~full & ~free.any(-1)).any()):
        return None
    protected = (position > (now - recent).view(-1, 1, 1)) | (position < sinks.view(-1, 1, 1))
    candidate = held & ~protected
    if bool((full & ~candidate.any(-1)).any()):
        raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")
    victim = _lowest(scores, position, candidate)
    return torch.where(full, victim, free.to(torch.int8).argmax(-1))


def attend_held(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: torch.Tensor,
    scores: torch.Tensor,
    rule: ScoreRule,
    scaling: float,
    triton: bool = False,
) -> torch.Tensor:
    """Steps 2-3 for one query per sequence [B, Hq, 1, D] over the held slots; updates ``scores`` in place.

    The attention and its group-summed probabilities come from ``decode_attention`` (``triton``: the Triton
    kernel of ``h2o_eval.kernels``) or its PyTorch reference.
    """
    attention = torch.zeros_like(scores)
    if triton:
        from h2o_eval.kernels.decode_attention import decode_attention

        output = decode_attention(query[:, :, 0], keys, values, held, attention, scaling)
    else:
        output = decode_attention_reference(query[:, :, 0], keys, values, held, attention, scaling)
    if rule is ScoreRule.ACCUMULATE:
        scores += attention
    elif rule is ScoreRule.CURRENT:
        scores.copy_(torch.where(held, attention, scores))
    return output.unsqueeze(2)
