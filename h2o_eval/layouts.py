"""How a settled :class:`~h2o_eval.layer.EvictionLayer` decodes one token per sequence: its decode layout, chosen
once when the layer settles after a chunk or a compression (:meth:`~h2o_eval.layer.EvictionLayer.settle`).

- :class:`Bounded`: a cache that evicts; each token claims a free slot or its victim's, in place
  (:func:`~h2o_eval.decode.claim`);
- :class:`Dense`: a cache that no longer evicts, its heads holding as many tokens: the next slot of buffers that grow
  in buckets (:func:`~h2o_eval.decode.append`);
- :class:`Ragged`: the same, each KV head holding its own count (:func:`~h2o_eval.decode.append_ragged`).

Each offers ``prepare`` (host work between steps: the buffers wide enough for one more token), ``step`` (device work
only, capturable as a CUDA graph), ``advance`` (its host counts, moved by eager and replayed steps alike through
:meth:`~h2o_eval.layer.EvictionLayer.advance`), ``tensors`` (what a captured step reads, by address), ``compacted``
(the slots a chunk starts from) and ``faults`` (what its steps noted on the device).
"""

from __future__ import annotations

from typing import Any

import torch

from h2o_eval.context import arriving_scores
from h2o_eval.decode import Slots, append, append_ragged, attend, bounded, bucket, claim, ragged, regrown, widened
from h2o_eval.policies import UNBOUNDED
from h2o_eval.policies.base import DecodeVote

# A layout reads and lays out its layer's slots, plan and sequences: ``layer`` below is that
# :class:`~h2o_eval.layer.EvictionLayer` (typed Any, as this module sits beneath the layer's).
EvictionLayer = Any

AHEAD = 64  # decode positions whose position scores are made at once (Policy.position_scores)


class Bounded:
    """The decode layout of a layer that evicts: each token claims a free slot or its victim's, in place
    (:func:`~h2o_eval.decode.claim`), in buffers laid out by :func:`~h2o_eval.decode.bounded`; its attention and,
    for a rule that scores while decoding, the scores come from the decode-attention kernel, else from torch's fused
    attention. ``most``: an upper bound on the tokens any head holds; ``largest``: the largest capacity; ``sinks``:
    whether any head has sinks; ``worst`` [B, Hkv, 1]: the highest lowest-candidate score of any claim, where a full
    head may have no candidate; ``ahead``: the policy's position scores of the next :data:`AHEAD` positions from
    ``ahead_base`` [B, 1, 1], made between steps."""

    def __init__(self, layer: EvictionLayer, most: int) -> None:
        plan, capacity = layer.plan, layer.plan.capacity
        self.most, self.largest = most, int(capacity.max())
        self.sinks = bool((plan.sinks > 0).any())
        self.scored = layer.context.rule.decode_votes != DecodeVote.NONE
        protected = (plan.recent + plan.sinks).view(-1, 1)
        self.worst = None
        if bool(((capacity < protected) & (capacity < UNBOUNDED)).any()):  # a full head may have no candidate
            self.worst = torch.full((*capacity.shape, 1), -torch.inf, device=capacity.device)
        self.ahead: torch.Tensor | None = None
        self.ahead_base: torch.Tensor | None = None
        self.ahead_left = 0
        if layer.context.policy.positional:
            self._scores_ahead(layer)
        layer.slots = bounded(layer.slots, capacity, min(self.largest, bucket(most + 1)))

    def prepare(self, layer: EvictionLayer) -> None:
        if self.ahead is not None and self.ahead_left <= 0:
            self._scores_ahead(layer)
        width = layer.slots.width
        if self.most >= width and width < self.largest:
            layer.slots = bounded(layer.slots, layer.plan.capacity, min(self.largest, bucket(self.most + 1)))

    def step(self, layer: EvictionLayer, query, key, value, scaling) -> torch.Tensor:
        context, slots, now, plan = layer.context, layer.slots, layer.shared.last, layer.plan
        if self.ahead is not None:  # position scores made ahead (prepare)
            start = self.ahead.gather(-1, (now - self.ahead_base).expand(-1, key.shape[1], 1))
        else:
            start = context.policy.key_scores(key, now.expand(-1, key.shape[1], 1), layer.layer_idx)
        lowest = claim(
            slots, key, value, now, layer.shared.limit(plan.recent),
            plan.sinks.view(-1, 1, 1) if self.sinks else None, 0.0 if start is None else start,
        )  # fmt: skip
        if self.worst is not None:
            torch.maximum(self.worst, lowest, out=self.worst)
        if self.scored:
            attention = context.implementation.decode_attention
            output = attention(
                query[:, :, 0], slots.keys, slots.values, slots.held, slots.scores, scaling, context.rule
            )
            return output.unsqueeze(2)
        return attend(query, slots, scaling)

    def advance(self) -> None:
        self.most = min(self.most + 1, self.largest)
        self.ahead_left -= 1

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.ahead, self.ahead_base, self.worst]

    def compacted(self, slots: Slots) -> Slots:
        return slots

    def faults(self) -> list[str]:
        if self.worst is not None and bool((self.worst == torch.inf).any()):
            return ["eviction needed but every held token is protected: the plan is inconsistent"]
        return []

    def _scores_ahead(self, layer: EvictionLayer) -> None:
        """Make (in place, where it exists) the policy's position scores of the next :data:`AHEAD` decode positions of
        each sequence, so that the next claims read them instead of computing them: from the position after the last
        token fed, then from where the previous table ended (decode positions follow one another)."""
        if self.ahead is None:
            self.ahead_base = layer.shared.last + 1
        else:
            self.ahead_base.add_(AHEAD)
        kv_heads = layer.slots.held.shape[1]
        position = (self.ahead_base + torch.arange(AHEAD, device=self.ahead_base.device)).expand(-1, kv_heads, AHEAD)
        scores = layer.context.policy.position_scores(position, layer.layer_idx)
        if self.ahead is None:
            self.ahead = scores
        else:
            self.ahead.copy_(scores)
        self.ahead_left = AHEAD


class Dense:
    """The decode layout of a layer that no longer evicts and whose heads hold as many tokens: each token goes into
    the next slot, ``fill`` [1] on the device (:func:`~h2o_eval.decode.append`), of buffers that grow in buckets
    (``filled``: the slots filled, on the host); a rule that drops frees what left the window below its threshold."""

    def __init__(self, layer: EvictionLayer, most: int) -> None:
        self.most, self.filled = most, layer.slots.width
        self.fill = torch.tensor([self.filled], dtype=torch.int64, device=layer.slots.held.device)

    def prepare(self, layer: EvictionLayer) -> None:
        if self.filled >= layer.slots.width:
            layer.slots = widened(layer.slots, bucket(self.filled + 1))

    def step(self, layer: EvictionLayer, query, key, value, scaling) -> torch.Tensor:
        append(layer.slots, key, value, layer.shared.last, self.fill)
        return layer.dropped(attend(query, layer.slots, scaling))

    def advance(self) -> None:
        self.filled += 1
        self.most += 1

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.fill]

    def compacted(self, slots: Slots) -> Slots:
        return slots.map(lambda tensor: tensor[:, :, : self.filled]) if self.filled < slots.width else slots

    def faults(self) -> list[str]:
        return []


class Ragged:
    """The decode layout of a layer that no longer evicts and whose heads hold different numbers of tokens (or that
    drops by a threshold): each head's token goes into its own next slot, ``count`` [B, Hkv] on the device
    (:func:`~h2o_eval.decode.append_ragged`), in rows laid out by :func:`~h2o_eval.decode.ragged` with ``room_left``
    free slots in every head; ``counts``: per sequence and KV head the tokens held when last laid out, ``grown``:
    tokens appended since."""

    def __init__(self, layer: EvictionLayer, counts: list[list[int]], room: int) -> None:
        self.most = max(max(row) for row in counts)
        self._lay_out(layer, counts, room)

    def _lay_out(self, layer: EvictionLayer, counts: list[list[int]], room: int, grown: bool = False) -> None:
        layer.slots = (regrown if grown else ragged)(layer.slots, room, counts)
        self.count = torch.tensor(counts, device=layer.slots.held.device)
        self.counts, self.grown, self.room_left = counts, 0, room

    def prepare(self, layer: EvictionLayer) -> None:
        if self.room_left > 0:
            return
        held = layer.slots.held.sum(-1).tolist() if layer.context.rule.drops else None  # one read per bucket
        counts = held or [[count + self.grown for count in row] for row in self.counts]  # (drops free slots)
        self.most = max(max(row) for row in counts)
        # a bucket's room for every head; without drops each head's tokens are its first slots, in order
        self._lay_out(layer, counts, bucket(self.most + 1) - self.most, grown=held is None)

    def step(self, layer: EvictionLayer, query, key, value, scaling) -> torch.Tensor:
        now, context = layer.shared.last, layer.context
        score = arriving_scores(context, key, now, layer.layer_idx)
        append_ragged(layer.slots, key, value, now, self.count, score)
        return layer.dropped(attend(query, layer.slots, scaling))

    def advance(self) -> None:
        self.room_left -= 1
        self.grown += 1
        self.most += 1

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.count]

    def compacted(self, slots: Slots) -> Slots:
        return slots.held_first(self.most)

    def faults(self) -> list[str]:
        return []
