"""One token per sequence into a layer's static buffers: the decode step, the one a CUDA graph captures and replays.

A layer's state is :class:`Slots`: keys and values [B, Hkv, S, D] and, per slot, whether it is held, the position of
its token and its score. A decode step writes into these tensors in place and allocates no state, reads no value on
the host, and takes its shapes from the buffers alone, so the same step can be captured once and replayed:

- :func:`claim` (a cache that evicts): each (sequence, KV head) gives up its victim, the unprotected held token with
  the lowest (score, position), or takes a free slot, and the token is written there (step 1 of
  :mod:`h2o_eval.eviction`);
- :func:`append` (a cache that no longer evicts): the token goes into the next slot of buffers that grow in buckets
  between steps (:func:`widened`);
- :func:`attend` attends to the held slots for a rule that needs no scores while decoding (steps 2-3 of a rule that
  votes are the decode-attention kernel's, :class:`~h2o_eval.implementation.Implementation`).

A bounded layer's buffers are exactly as wide as its largest capacity, laid out by :func:`bounded`: in each
(sequence, KV head) the first C slots are live, held or **free** (position :data:`FREE`, score -inf: older than any
protection and lower than any score, so the lowest-scoring candidate is a free slot while one is left), and the rest
are **dead** (position :data:`DEAD`: never a candidate, never held), so that a head whose C is below the layer's
largest never grows past C. The victim is found by comparisons alone, with no count of held tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

FREE = -(2**62)  # the position of a free slot
FILLS = (0, 0, False, FREE, -torch.inf)  # what a free slot's keys, values, held, position and score hold
DEAD = 2**62  # the position of a slot beyond its KV head's capacity
BUCKET = 64  # growing buffers take whole buckets of slots: at least one, and at least 1/64 of what they hold


@dataclass
class Slots:
    """A layer's state per slot. ``keys``, ``values``: [B, Hkv, S, D]; ``held``: [B, Hkv, S] bool; ``position``:
    [B, Hkv, S] int64, each slot's token index in its sequence; ``scores``: [B, Hkv, S] float32. A slot that is not
    held is free: the next token may take it. Everything a decode step changes is one of these tensors, in place.

    ``entry``: None, or the ragged layout (:func:`ragged`): keys and values are rows [B, E, D] and ``entry`` [B, Hkv,
    S] gives each slot's row, so that each KV head takes the rows of what it holds, not the fullest head's."""

    keys: torch.Tensor
    values: torch.Tensor
    held: torch.Tensor
    position: torch.Tensor
    scores: torch.Tensor
    entry: torch.Tensor | None = None

    @classmethod
    def empty(cls, key: torch.Tensor, value: torch.Tensor) -> Slots:
        """No slots, for sequences and heads shaped as ``key`` [B, Hkv, n, D]."""
        batch, kv_heads = key.shape[:2]
        device = key.device
        return cls(
            key[:, :, :0],
            value[:, :, :0],
            torch.zeros(batch, kv_heads, 0, dtype=torch.bool, device=device),
            torch.zeros(batch, kv_heads, 0, dtype=torch.int64, device=device),
            torch.zeros(batch, kv_heads, 0, dtype=torch.float32, device=device),
        )

    @property
    def width(self) -> int:
        return self.held.shape[-1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        fields = (getattr(self, field.name) for field in dataclasses.fields(self))
        return tuple(tensor for tensor in fields if tensor is not None)

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> Slots:
        """These slots (in the dense layout) with ``function`` applied to every tensor."""
        return Slots(*(function(tensor) for tensor in self.dense().tensors()))

    def dense(self) -> Slots:
        """These slots with keys and values [B, Hkv, S, D]: as they are, or a ragged layout's gathered (a copy)."""
        if self.entry is None:
            return self
        return Slots(
            rows_at(self.keys, self.entry), rows_at(self.values, self.entry), self.held, self.position, self.scores
        )

    def rows(self, rows: list[int]) -> Slots:
        """A copy of the sequences ``rows`` (in the dense layout)."""
        index = torch.tensor(rows, device=self.held.device)
        return self.map(lambda tensor: tensor[index])

    def held_first(self, size: int | None = None) -> Slots:
        """These slots (in the dense layout) with the held ones first in each (sequence, KV head), in their order,
        cut to ``size``."""
        slots = self.dense()
        order = torch.argsort((~slots.held).to(torch.int8), dim=-1, stable=True)[..., :size]
        index = order.unsqueeze(-1).expand(-1, -1, -1, slots.keys.shape[-1])
        return Slots(
            slots.keys.gather(2, index),
            slots.values.gather(2, index),
            slots.held.gather(-1, order),
            slots.position.gather(-1, order),
            slots.scores.gather(-1, order),
        )


def rows_at(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows ``index`` [B, ...] of each sequence's ``tensor`` [B, N, D]: [B, ..., D], a copy. One index_select over
    the flattened rows: torch.gather with an index expanded over D reads an index per element, several times slower
    on CPU (a ragged layout's keys and values are gathered at every decode step)."""
    batch, count, dim = tensor.shape
    flat = index.reshape(batch, -1)
    if batch > 1:
        flat = flat + torch.arange(0, batch * count, count, device=index.device).unsqueeze(-1)
    return tensor.reshape(batch * count, dim).index_select(0, flat.view(-1)).view(*index.shape, dim)


def widened(slots: Slots, size: int) -> Slots:
    """``slots`` in new contiguous buffers of ``size`` slots (at least their width), the new slots free (dense)."""
    slots = slots.dense()
    if size == slots.width and all(tensor.is_contiguous() for tensor in slots.tensors()):
        return slots
    return laid_out([(slots, 0, slots.width)], slots.keys.shape[0], size)


def laid_out(parts: list[tuple[Slots, int, int]], rows: int, size: int) -> Slots:
    """New buffers of ``rows`` rows and ``size`` slots (dense), each part's slots copied in: ``(slots, row, width)``
    puts the first ``width`` slots of each of its rows from ``row`` on, every slot after them free
    (:data:`FILLS`)."""
    buffers = []
    for index, fill in enumerate(FILLS):
        like = parts[0][0].tensors()[index]
        buffer = like.new_empty((rows, like.shape[1], size, *like.shape[3:]))
        for slots, row, width in parts:
            tensor = slots.tensors()[index]
            held, end = min(tensor.shape[2], width), row + tensor.shape[0]
            buffer[row:end, :, :held] = tensor[:, :, :held]
            buffer[row:end, :, held:].fill_(fill)
        buffers.append(buffer)
    return Slots(*buffers)


def ragged(slots: Slots, room: int, counts: list[list[int]]) -> Slots:
    """The layout of a layer whose KV heads hold different numbers of tokens and no longer evict: in each sequence,
    each head's held tokens then ``room`` free slots are contiguous rows of keys and values [B, E, D] (E: the
    longest sequence's rows, and one spare row for the slots past a head's room, which are never held), and
    ``entry`` gives each slot's row. The keys and values take the bytes of what the heads hold and their room, not
    every head padded to the fullest one (Ada-KV's and KVzip's budgets differ per head). ``counts``: per sequence
    and KV head the tokens held, known on the host, so that nothing is read from the device."""
    sizes = [[count + room for count in row] for row in counts]
    total, width = max(sum(row) for row in sizes), max(max(row) for row in sizes)
    device = slots.held.device
    size = torch.tensor(sizes, device=device)
    slots = widened(slots.held_first(), max(width, slots.width)).map(lambda tensor: tensor[:, :, :width])
    columns = torch.arange(width, device=device)
    entry = torch.where(columns < size.unsqueeze(-1), (size.cumsum(-1) - size).unsqueeze(-1) + columns, total)
    batch, kv_heads, _, dim = slots.keys.shape
    index = entry.view(batch, kv_heads * width, 1).expand(-1, -1, dim)
    rows = []
    for tensor in (slots.keys, slots.values):
        rows.append(tensor.new_zeros(batch, total + 1, dim).scatter_(1, index, tensor.reshape(batch, -1, dim)))
    return Slots(*rows, slots.held, slots.position, slots.scores, entry)


def regrown(slots: Slots, room: int, counts: list[list[int]]) -> Slots:
    """:func:`ragged`'s layout of ``slots``, a ragged layout whose heads hold their first ``counts`` slots (nothing
    dropped since it was laid out: each head's tokens are its first slots, in order), with ``room`` free slots
    after each head's tokens: each held row is copied to its new place, and nothing is sorted or gathered into
    the dense layout first (a regrowth while decoding)."""
    sizes = [[count + room for count in row] for row in counts]
    total, width = max(sum(row) for row in sizes), max(max(row) for row in sizes)
    device = slots.held.device
    size, count = torch.tensor(sizes, device=device), torch.tensor(counts, device=device).unsqueeze(-1)
    columns = torch.arange(width, device=device)
    entry = torch.where(columns < size.unsqueeze(-1), (size.cumsum(-1) - size).unsqueeze(-1) + columns, total)
    kept = min(width, slots.width)
    held = columns[:kept] < count  # [B, Hkv, kept]: where a held row moves
    spare = slots.keys.shape[1] - 1
    source = torch.where(held, slots.entry[..., :kept], spare).flatten(1).unsqueeze(-1)
    target = torch.where(held, entry[..., :kept], total).flatten(1).unsqueeze(-1)
    batch, _, dim = slots.keys.shape
    rows = []
    for tensor in (slots.keys, slots.values):
        moved = tensor.gather(1, source.expand(-1, -1, dim))
        rows.append(tensor.new_zeros(batch, total + 1, dim).scatter_(1, target.expand(-1, -1, dim), moved))
    state = []
    for tensor, fill in zip((slots.held, slots.position, slots.scores), FILLS[2:], strict=True):
        grown = tensor.new_full((*tensor.shape[:2], width), fill)
        grown[..., :kept] = tensor[..., :kept]
        state.append(grown)
    return Slots(*rows, *state, entry)


def bucket(size: int) -> int:
    """The width of growing buffers that must hold ``size`` slots: a whole number of :data:`BUCKET` s, with at least
    ``size // 64`` slots to spare, so that a decode step rarely copies the layer and a CUDA graph captured for one
    width is replayed for many steps."""
    spare = max(size // 64, 1)
    return -(-(size + spare) // BUCKET) * BUCKET


def bounded(slots: Slots, capacity: torch.Tensor, size: int) -> Slots:
    """The layout a bounded layer decodes in, ``size`` slots wide (its largest C, or a bucket short of it while a
    head may still grow): in each (sequence, KV head) the held slots first, in their order, then free slots up to
    the head's C, then dead ones (see the module). Every head holds at most ``size`` tokens."""
    slots = widened(slots.held_first(size), size)
    live = torch.arange(size, device=capacity.device) < capacity.unsqueeze(-1)
    slots.position.copy_(torch.where(slots.held, slots.position, torch.where(live, FREE, DEAD)))
    slots.scores.masked_fill_(~slots.held, -torch.inf)
    return slots


def claim(
    slots: Slots,
    key: torch.Tensor,
    value: torch.Tensor,
    now: torch.Tensor,
    limit: torch.Tensor,
    sinks: torch.Tensor | None,
    start: torch.Tensor | float | None,
) -> torch.Tensor:
    """Step 1 for one token per sequence (``key``, ``value`` [B, Hkv, 1, D]) at position ``now`` [B, 1, 1]: in each
    (sequence, KV head) the candidates are the held slots older than ``limit`` [B, 1, 1] (= now - recent) and not
    among the first ``sinks`` [B, 1, 1] (None: no sinks), and the free ones; the one with the lowest score (the
    smallest position among equal scores) takes the token, whose score becomes ``start`` (None: left as it was,
    for a rule whose scores never change). Returns [B, Hkv, 1] the lowest candidate score, +inf where a head had
    no candidate (every held token protected: an inconsistent plan)."""
    protected = slots.position > limit
    if sinks is not None:
        protected |= slots.position < sinks
    ranked = slots.scores.masked_fill(protected, torch.inf)
    lowest = ranked.amin(-1, keepdim=True)
    slot = slots.position.masked_fill(ranked != lowest, DEAD).argmin(-1, keepdim=True)  # [B, Hkv, 1]
    index = slot.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1])
    slots.keys.scatter_(2, index, key)
    slots.values.scatter_(2, index, value)
    slots.held.scatter_(-1, slot, True)
    slots.position.scatter_(-1, slot, now.expand_as(slot))
    if start is not None:
        slots.scores.scatter_(-1, slot, start)
    return lowest


def append(slots: Slots, key: torch.Tensor, value: torch.Tensor, now: torch.Tensor, width: torch.Tensor) -> None:
    """One token per sequence (``key``, ``value`` [B, Hkv, 1, D]) at position ``now`` [B, 1, 1] into slot ``width``
    ([1] int64, on the device, then advanced), which the buffers have (:func:`bucket`)."""
    slots.keys.index_copy_(2, width, key)
    slots.values.index_copy_(2, width, value)
    slots.held.index_fill_(2, width, True)
    slots.position.index_copy_(2, width, now.expand(-1, key.shape[1], 1))
    width.add_(1)


def append_ragged(
    slots: Slots,
    key: torch.Tensor,
    value: torch.Tensor,
    now: torch.Tensor,
    count: torch.Tensor,
    score: torch.Tensor | None = None,
) -> None:
    """:func:`append` into a ragged layout (:func:`ragged`): each KV head's token into its next slot, ``count``
    [B, Hkv] (on the device, then advanced), whose row its room holds; with its ``score`` [B, Hkv, 1] (None: the
    slot's score is left as it was, for a rule that reads none)."""
    at = count.unsqueeze(-1)
    row = slots.entry.gather(-1, at).expand(-1, -1, key.shape[-1])
    slots.keys.scatter_(1, row, key[:, :, 0])
    slots.values.scatter_(1, row, value[:, :, 0])
    slots.held.scatter_(-1, at, True)
    slots.position.scatter_(-1, at, now.expand_as(at))
    if score is not None:
        slots.scores.scatter_(-1, at, score)
    count.add_(1)


def drop(slots: Slots, limit: torch.Tensor, threshold: float) -> None:
    """Free, in place, the held slots whose token is at most at ``limit`` [B, 1, 1] (= now - recent: it has left the
    protected window) and whose score is below ``threshold`` (a threshold while decoding): they are no longer held,
    and a layout's next regrowth leaves them out. Nothing is read on the host."""
    slots.held.logical_and_((slots.position > limit) | (slots.scores >= threshold))


def attend(query: torch.Tensor, slots: Slots, scaling: float) -> torch.Tensor:
    """One query per sequence [B, Hq, 1, D] over the held slots, through torch's fused attention (SDPA), for a rule
    that needs no attention scores: each KV head's G query heads are G query rows of that head, so nothing is
    repeated and the mask broadcasts over them. Returns [B, Hq, 1, D]."""
    slots = slots.dense()
    batch, q_heads, _, dim = query.shape
    kv_heads = slots.keys.shape[1]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    output = torch.nn.functional.scaled_dot_product_attention(
        grouped, slots.keys, slots.values, attn_mask=slots.held.unsqueeze(2), scale=scaling
    )
    return output.reshape(batch, q_heads, 1, dim)
