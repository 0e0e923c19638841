"""The decode phase's row scan for the CPU, compiled with numba: the Triton ``eviction_scan``'s counterpart.

One (sequence, KV head) per parallel iteration walks a block of rows in order, as a cache fed token by token
would: evict the lowest-scored unprotected held slot if the cache is full (ties: the smallest position), admit
the row's token, attend over the held slots with the block's precomputed logits, and fold the attention into the
scores (``votes`` 0: add, 1: replace, 2: leave them). It records when each slot entered and left, so the caller
can compute the block's outputs with one masked softmax. Its reference is the mechanism's definition,
:func:`h2o_eval.eviction.attend_chunk_reference`.

Shapes: logits [B, Hkv, G, rows, columns] float32 (rows row0.. of the chunk, against the block's live slots);
held [B, Hkv, N] bool; arriving [B, n] bool; position [B, Hkv, N] int64; scores [B, Hkv, N] float32; capacity
[B, Hkv]; recent, sinks [B]; enter, leave [B, Hkv, N] int64 (chunk rows); stuck [B, Hkv] bool; column [B, Hkv, N]
int64, each slot's column in the logits (read only for the slots held during the block). Slot of chunk row r:
N - n + r.
"""

from __future__ import annotations

import numba
import numpy as np


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
def scan_rows(
    logits, row0, held, arriving, position, scores, capacity, recent, sinks, votes, enter, leave, stuck, column
):  # fmt: skip
    batch, kv_heads, group, rows, _ = logits.shape
    num_slots = held.shape[2]
    n = arriving.shape[1]
    state = num_slots - n
    for bh in numba.prange(batch * kv_heads):
        b = bh // kv_heads
        h = bh % kv_heads
        if stuck[b, h]:
            continue
        slots = np.empty(num_slots, dtype=np.int64)
        weights = np.empty(num_slots, dtype=np.float64)
        attention = np.empty(num_slots, dtype=np.float64)
        count = 0
        for j in range(num_slots):
            if held[b, h, j]:
                slots[count] = j
                count += 1
        for i in range(rows):
            r = row0 + i
            if not arriving[b, r]:
                continue
            now = position[b, h, state + r]
            if count >= capacity[b, h]:
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
            if votes <= 1:
                for k in range(count):
                    attention[k] = 0.0
                for g in range(group):
                    top = -np.inf
                    for k in range(count):
                        top = max(top, logits[b, h, g, i, column[b, h, slots[k]]])
                    total = 0.0
                    for k in range(count):
                        weights[k] = np.exp(logits[b, h, g, i, column[b, h, slots[k]]] - top)
                        total += weights[k]
                    for k in range(count):
                        attention[k] += np.float32(weights[k] / total)
                for k in range(count):
                    if votes == 0:
                        scores[b, h, slots[k]] += np.float32(attention[k])
                    else:
                        scores[b, h, slots[k]] = np.float32(attention[k])
