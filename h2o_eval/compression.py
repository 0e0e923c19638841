"""A prompt compressed to C at once: the vectorised form of the definition's single evictions
(:func:`h2o_eval.eviction.attend_chunk_reference`), after the prompt's scores are pooled along positions."""

from __future__ import annotations

from collections.abc import Callable

import torch

from h2o_eval.eviction import protected_slots
from h2o_eval.policies import UNBOUNDED, Rule
from h2o_eval.policies.pooling import pool_scores


def compress(
    held: torch.Tensor,
    scores: torch.Tensor,
    position: torch.Tensor,
    capacity: torch.Tensor,
    recent: torch.Tensor,
    sinks: torch.Tensor,
    now: torch.Tensor,
    rule: Rule,
    rescore: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress a prompt's cache to its capacity; returns (held, scores, capacity after the prompt).

    ``now`` [B] is the position of each sequence's last prompt token (-1: no prompt, nothing changes). The
    scores of the tokens older than the recent window are pooled (``rule.pooling``), then handed to ``rescore``
    (the policy's own scores, see :class:`Chunk`); the protected tokens stay;
    of the rest, the lowest (score, position) go until each KV head holds its C. With ``rule.safeguard`` the
    heads of the layer share their Hkv * C slots instead: each keeps its protected tokens and its
    floor(safeguard * C) best, the remaining slots go to the best of the layer (ties: lowest score, then smallest
    position, then lowest head goes first). With ``rule.threshold`` every candidate scoring below it goes instead,
    whatever C. After the prompt, C is unbounded if the rule grows, else what each head holds (at most its C).
    """
    batch, kv_heads, slots = scores.shape
    device = scores.device
    active = (now >= 0).view(-1, 1, 1)
    protected = protected_slots(position, now, recent, sinks) & held
    older = held & (position <= (now - recent).view(-1, 1, 1)) & active
    scores = pool_scores(scores, older, rule)
    if rescore is not None:
        scores = torch.where(active, rescore(scores, protected & active), scores)
    candidate = held & ~protected & active
    if rule.threshold is not None:  # a rule with a threshold grows (Rule)
        return held & ~(candidate & (scores < rule.threshold)), scores, torch.where(active[..., 0], UNBOUNDED, capacity)
    # Rank candidates per head, best first: higher score, then larger position (ties: the oldest goes).
    order = torch.argsort(-position, dim=-1, stable=True)
    order = order.gather(
        -1, torch.argsort((-scores).masked_fill(~candidate, torch.inf).gather(-1, order), dim=-1, stable=True)
    )
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(slots, device=device).expand_as(order))
    room = (capacity - protected.sum(-1)).clamp(min=0)  # [B, Hkv] candidates each head may keep
    if rule.safeguard is None:
        keep = candidate & (rank < room.unsqueeze(-1))
    else:
        guaranteed = torch.minimum(room, (rule.safeguard * capacity).floor().long() - protected.sum(-1))
        sure = candidate & (rank < guaranteed.clamp(min=0).unsqueeze(-1))
        shared = capacity.sum(-1) - protected.sum((-1, -2)) - sure.sum((-1, -2))  # [B] slots left in the layer
        rest = candidate & ~sure
        # Rank the rest across the layer's heads: higher score, then larger position, then higher head first.
        flat_scores = scores.masked_fill(~rest, -torch.inf).reshape(batch, -1)
        flat_position = position.reshape(batch, -1)
        head = torch.arange(kv_heads, device=device).repeat_interleave(slots).expand(batch, -1)
        flat_order = torch.argsort(-head, dim=-1, stable=True)
        for key in (flat_position, flat_scores):
            flat_order = flat_order.gather(-1, torch.argsort(-key.gather(-1, flat_order), dim=-1, stable=True))
        flat_rank = torch.empty_like(flat_order).scatter_(
            -1, flat_order, torch.arange(flat_order.shape[-1], device=device).expand_as(flat_order)
        )
        keep = sure | (rest & (flat_rank < shared.view(-1, 1)).view(batch, kv_heads, slots))
    held = held & (~candidate | keep)
    if rule.grows:
        after = torch.where(active[..., 0], UNBOUNDED, capacity)
    elif rule.safeguard is not None:
        after = torch.where(active[..., 0], held.sum(-1), capacity)
    else:
        after = capacity
    return held, scores, after
