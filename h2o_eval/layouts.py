"""How a settled :class:`~h2o_eval.layer.EvictionLayer` decodes one token per sequence: its decode layout, chosen
once when the layer settles after a chunk or a compression (:meth:`~h2o_eval.layer.EvictionLayer.settle`). A layout
is the whole one-token step: it owns the slots it writes, and binds what its steps read (:class:`Binding`) when it is
made, so that nothing of the layer is read or written while decoding.

- :class:`Bounded`: a cache that evicts; each token claims a free slot or its victim's, in place
  (:func:`~h2o_eval.decode.claim`);
- :class:`Dense`: a cache that no longer evicts, its heads holding as many tokens: the next slot of buffers that grow
  in buckets (:func:`~h2o_eval.decode.append`);
- :class:`Ragged`: the same, each KV head holding its own count (:func:`~h2o_eval.decode.append_ragged`).

Each is a :class:`DecodeLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from h2o_eval.context import LayerContext, Plan, Sequences, arriving_scores
from h2o_eval.decode import Slots, append, append_ragged, attend, bounded, bucket, claim, drop, ragged, regrown, widened
from h2o_eval.policies import UNBOUNDED
from h2o_eval.policies.base import DecodeVote

AHEAD = 64  # decode positions whose position scores are made at once (Policy.position_scores)


@runtime_checkable
class DecodeLayout(Protocol):
    """The contract of a decode layout. ``slots``: the buffers it owns (its layer's state while it decodes);
    ``most``: an upper bound on the tokens any head holds.

    - ``prepare()``: host work between steps (the buffers wide enough for one more token, scores made ahead);
    - ``step(query, key, value)``: device work only, capturable as a CUDA graph: the token's keys and values
      [B, Hkv, 1, D] into the slots, and the attention output [B, Hq, 1, D] of ``query`` over them;
    - ``advance()``: its host counts after a step, eager or replayed (:mod:`h2o_eval.graphs`);
    - ``tensors()``: what a captured step reads besides the slots, by address;
    - ``compacted()``: the slots a chunk or a copy starts from (the filled ones, in the dense layout);
    - ``faults()``: what its steps noted on the device (reading them waits for it).

    Adding one: a class with these, made by :meth:`~h2o_eval.layer.EvictionLayer.settle` where its case applies."""

    slots: Slots
    most: int

    def prepare(self) -> None: ...

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor: ...

    def advance(self) -> None: ...

    def tensors(self) -> list[torch.Tensor | None]: ...

    def compacted(self) -> Slots: ...

    def faults(self) -> list[str]: ...


@dataclass(frozen=True)
class Binding:
    """What a layout's steps read besides its slots, bound when it is made: the layer's ``context`` (policy, rule,
    kernels), its sequences (``shared``: the positions now, the recent windows' limits), its ``plan``, its index
    ``layer`` and its logit scale ``scaling``."""

    context: LayerContext
    shared: Sequences
    plan: Plan
    layer: int
    scaling: float

    def dropped(self, slots: Slots, output: torch.Tensor | None = None) -> torch.Tensor | None:
        """End a forward (returns ``output``): a rule that drops frees what left the window below its threshold."""
        rule = self.context.rule
        if rule.drops:
            drop(slots, self.shared.limit(self.plan.recent), rule.threshold)
        return output


class Bounded:
    """The decode layout of a layer that evicts: each token claims a free slot or its victim's, in place
    (:func:`~h2o_eval.decode.claim`), in buffers laid out by :func:`~h2o_eval.decode.bounded` from ``slots``; its
    attention and, for a rule that scores while decoding, the scores come from the decode-attention kernel, else from
    torch's fused attention (``attention``: the kernel bound to the rule, or None). ``keyed``: whether the policy scores
    each arriving key (else its scores start at 0, or at its position's score). ``most``: an upper bound on the tokens
    any head holds; ``largest``: the largest capacity; ``sinks``: whether any head has sinks; ``worst`` [B, Hkv, 1]: the
    highest lowest-candidate score of any claim, where a full head may have no candidate; ``ahead``: the policy's
    position scores of the next :data:`AHEAD` positions from ``ahead_base`` [B, 1, 1], made between steps."""

    def __init__(self, slots: Slots, bound: Binding, most: int) -> None:
        plan, capacity = bound.plan, bound.plan.capacity
        self.bound, self.most, self.largest = bound, most, int(capacity.max())
        self.sinks = bool((plan.sinks > 0).any())
        rule = bound.context.rule
        self.attention = None
        if rule.decode_votes != DecodeVote.NONE:  # a rule that scores while decoding: the decode-attention kernel
            self.attention = bound.context.implementation.decode_attention(rule)
        self.keyed = bound.context.policy.keyed
        protected = (plan.recent + plan.sinks).view(-1, 1)
        self.worst = None
        if bool(((capacity < protected) & (capacity < UNBOUNDED)).any()):  # a full head may have no candidate
            self.worst = torch.full((*capacity.shape, 1), -torch.inf, device=capacity.device)
        self.ahead: torch.Tensor | None = None
        self.ahead_base: torch.Tensor | None = None
        self.ahead_left = 0
        self.slots = bounded(slots, capacity, min(self.largest, bucket(most + 1)))
        if bound.context.policy.positional:
            self._scores_ahead()

    def prepare(self) -> None:
        if self.ahead is not None and self.ahead_left <= 0:
            self._scores_ahead()
        width = self.slots.width
        if self.most >= width and width < self.largest:
            self.slots = bounded(self.slots, self.bound.plan.capacity, min(self.largest, bucket(self.most + 1)))

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        bound, slots = self.bound, self.slots
        context, now, plan = bound.context, bound.shared.last, bound.plan
        start = None
        if self.ahead is not None:  # position scores made ahead (prepare)
            start = self.ahead.gather(-1, (now - self.ahead_base).expand(-1, key.shape[1], 1))
        elif self.keyed:
            start = context.policy.key_scores(key, now.expand(-1, key.shape[1], 1), bound.layer)
        lowest = claim(
            slots, key, value, now, bound.shared.limit(plan.recent),
            plan.sinks.view(-1, 1, 1) if self.sinks else None, 0.0 if start is None else start,
        )  # fmt: skip
        if self.worst is not None:
            torch.maximum(self.worst, lowest, out=self.worst)
        if self.attention is not None:
            output = self.attention(query[:, :, 0], slots.keys, slots.values, slots.held, slots.scores, bound.scaling)
            return output.unsqueeze(2)
        return attend(query, slots, bound.scaling)

    def advance(self) -> None:
        self.most = min(self.most + 1, self.largest)
        self.ahead_left -= 1

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.ahead, self.ahead_base, self.worst]

    def compacted(self) -> Slots:
        return self.slots

    def faults(self) -> list[str]:
        if self.worst is not None and bool((self.worst == torch.inf).any()):
            return ["eviction needed but every held token is protected: the plan is inconsistent"]
        return []

    def _scores_ahead(self) -> None:
        """Make (in place, where it exists) the policy's position scores of the next :data:`AHEAD` decode positions of
        each sequence, so that the next claims read them instead of computing them: from the position after the last
        token fed, then from where the previous table ended (decode positions follow one another)."""
        bound = self.bound
        if self.ahead is None:
            self.ahead_base = bound.shared.last + 1
        else:
            self.ahead_base.add_(AHEAD)
        kv_heads = self.slots.held.shape[1]
        position = (self.ahead_base + torch.arange(AHEAD, device=self.ahead_base.device)).expand(-1, kv_heads, AHEAD)
        scores = bound.context.policy.position_scores(position, bound.layer)
        if self.ahead is None:
            self.ahead = scores
        else:
            self.ahead.copy_(scores)
        self.ahead_left = AHEAD


class Dense:
    """The decode layout of a layer that no longer evicts and whose heads hold as many tokens: each token goes into
    the next slot, ``fill`` [1] on the device (:func:`~h2o_eval.decode.append`), of buffers that grow in buckets
    (``filled``: the slots filled, on the host); a rule that drops frees what left the window below its threshold."""

    def __init__(self, slots: Slots, bound: Binding, most: int) -> None:
        self.slots, self.bound = slots, bound
        self.most, self.filled = most, slots.width
        self.fill = torch.tensor([self.filled], dtype=torch.int64, device=slots.held.device)

    def prepare(self) -> None:
        if self.filled >= self.slots.width:
            self.slots = widened(self.slots, bucket(self.filled + 1))

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        bound = self.bound
        append(self.slots, key, value, bound.shared.last, self.fill)
        return bound.dropped(self.slots, attend(query, self.slots, bound.scaling))

    def advance(self) -> None:
        self.filled += 1
        self.most += 1

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.fill]

    def compacted(self) -> Slots:
        slots = self.slots
        return slots.map(lambda tensor: tensor[:, :, : self.filled]) if self.filled < slots.width else slots

    def faults(self) -> list[str]:
        return []


class Ragged:
    """The decode layout of a layer that no longer evicts and whose heads hold different numbers of tokens (or that
    drops by a threshold): each head's token goes into its own next slot, ``count`` [B, Hkv] on the device
    (:func:`~h2o_eval.decode.append_ragged`), in rows laid out by :func:`~h2o_eval.decode.ragged` with ``room_left``
    free slots in every head; ``counts``: per sequence and KV head the tokens held when last laid out, ``grown``:
    tokens appended since."""

    def __init__(self, slots: Slots, bound: Binding, counts: list[list[int]], room: int) -> None:
        self.slots, self.bound = slots, bound
        self.most = max(max(row) for row in counts)
        self._lay_out(counts, room)

    def _lay_out(self, counts: list[list[int]], room: int, grown: bool = False) -> None:
        self.slots = (regrown if grown else ragged)(self.slots, room, counts)
        self.count = torch.tensor(counts, device=self.slots.held.device)
        self.counts, self.grown, self.room_left = counts, 0, room

    def prepare(self) -> None:
        if self.room_left > 0:
            return
        held = self.slots.held.sum(-1).tolist() if self.bound.context.rule.drops else None  # one read per bucket
        counts = held or [[count + self.grown for count in row] for row in self.counts]  # (drops free slots)
        self.most = max(max(row) for row in counts)
        # a bucket's room for every head; without drops each head's tokens are its first slots, in order
        self._lay_out(counts, bucket(self.most + 1) - self.most, grown=held is None)

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        bound = self.bound
        now = bound.shared.last
        score = arriving_scores(bound.context, key, now, bound.layer)
        append_ragged(self.slots, key, value, now, self.count, score)
        return bound.dropped(self.slots, attend(query, self.slots, bound.scaling))

    def advance(self) -> None:
        self.room_left -= 1
        self.grown += 1
        self.most += 1

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.count]

    def compacted(self) -> Slots:
        return self.slots.held_first(self.most)

    def faults(self) -> list[str]:
        return []
