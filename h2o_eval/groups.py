"""Several :class:`~h2o_eval.cache.EvictionCache` s fed as one: :class:`SharedPrompt` feeds one prompt to the caches
of several policies, its attention computed once; :class:`StackedCache` answers one question batch from several
compressed caches (:meth:`~h2o_eval.cache.EvictionCache.stack`).

Both take the caches' layers as they are and call their ``update`` and ``attend``: nothing here knows more of a
cache than its layers."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_eval.attention import key_validity, plain_attention
from h2o_eval.decode import BUCKET, Slots, attend, bucket, laid_out
from h2o_eval.errors import ConfigError
from h2o_eval.graphs import host_state, restore_host_state
from h2o_eval.kernels.reference import CONSTANTS
from h2o_eval.layer import EvictionLayer


class LayersOfCaches(CacheLayerMixin):
    """One layer of several caches fed as one: ``layers``, one per cache, all having seen the same tokens."""

    is_sliding = False
    is_croppable = False

    def __init__(self, layers: list[EvictionLayer]) -> None:
        super().__init__()
        self.layers = layers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def check_attended(self) -> None:
        for layer in self.layers:
            layer.check_attended()

    def get_seq_length(self) -> int:
        return self.layers[0].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1


ROOM = 128  # slots a group lays out beyond a bucket of what it holds (an answer's tokens): it seldom widens


class Group:
    """Rows of a :class:`StackedDecode` that hold about as many tokens: ``slots`` their buffers (dense, each row's
    held slots first), ``count`` [P, Hkv] each row's next slot per KV head, ``most`` (on the host) the most any of
    them holds; ``rows`` the stack's rows (its batch order) it answers for, and ``physical`` theirs in its buffers
    (both increasing). Rows that left stay in the buffers, neither read nor copied: a step appends to the rows that
    go on and attends them by ``runs`` of consecutive buffer rows (views), until a widening copies the rows that go
    on alone (:meth:`prepare`)."""

    def __init__(self, slots: Slots, count: torch.Tensor, most: int, rows: list[int], physical: list[int]) -> None:
        self.slots, self.count, self.most = slots, count, most
        self.rows, self.physical = rows, physical
        device = count.device
        self.rows_index = torch.tensor(rows, dtype=torch.int64, device=device)
        self.physical_index = torch.tensor(physical, dtype=torch.int64, device=device)
        self.whole = physical == list(range(count.shape[0])) and rows == list(range(rows[0], rows[0] + len(rows)))
        self.runs = runs(physical)

    def step(self, query, key, value, positions, scaling, output: torch.Tensor) -> None:
        """Append the chunk's tokens (``key``, ``value`` [N, Hkv, n, D] at ``positions`` [N, n], the stack's rows) to
        this group's rows, each token attending to what its row held and to the chunk's tokens up to itself, and
        write their attention into ``output`` [N, Hq, n, D]."""
        key, value, query, positions = (self._mine(tensor) for tensor in (key, value, query, positions))
        slots, physical, n = self.slots, self.physical_index, key.shape[2]
        start = self.count.index_select(0, physical)  # [b, Hkv]
        at = start.unsqueeze(-1) + torch.arange(n, device=start.device)  # [b, Hkv, n]
        rows = physical.view(-1, 1, 1).expand_as(at)
        heads = torch.arange(at.shape[1], device=at.device).view(1, -1, 1).expand_as(at)
        slots.keys.index_put_((rows, heads, at), key)
        slots.values.index_put_((rows, heads, at), value)
        slots.held.index_put_((rows, heads, at), torch.ones_like(at, dtype=torch.bool))
        slots.position.index_put_((rows, heads, at), positions.unsqueeze(1).expand_as(at))
        self.count.index_add_(0, physical, torch.full_like(start, n))
        parts, used = [], self.used(n)
        for first, end, mine in self.runs:  # views of the buffers' rows that go on, as wide as they are used
            run = Slots(*(tensor[first:end, :, :used] for tensor in slots.tensors()))
            part = slice(mine, mine + end - first)
            if n == 1:
                parts.append(attend(query[part], run, scaling))
            else:
                parts.append(attend_chunk_causally(query[part], run, start[part], scaling))
        attended = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.whole:
            output[self.rows[0] : self.rows[-1] + 1] = attended
        else:
            output.index_copy_(0, self.rows_index, attended)

    def used(self, n: int) -> int:
        """How many of the buffers' slots a step of ``n`` tokens attends: the buckets any row fills."""
        return min(self.slots.width, -(-(self.most + n) // BUCKET) * BUCKET)

    def _mine(self, tensor: torch.Tensor) -> torch.Tensor:
        """This group's rows of a tensor of the stack's rows."""
        return tensor[self.rows[0] : self.rows[-1] + 1] if self.whole else tensor.index_select(0, self.rows_index)

    def prepare(self, n: int) -> Group:
        """Before a step of ``n`` tokens, on the host: this group with buffers wide enough for them in every row (a
        new bucket, into which the rows that go on are copied, run by run, and nothing else)."""
        width = self.slots.width
        if self.most + n <= width:
            return self
        rows = len(self.physical)
        runs = [(Slots(*(t[first:end] for t in self.slots.tensors())), mine, width) for first, end, mine in self.runs]
        grown = laid_out(runs, rows, bucket(self.most + n) + ROOM)
        count = self.count if rows == self.count.shape[0] else self.count.index_select(0, self.physical_index)
        return Group(grown, count, self.most, self.rows, list(range(rows)))

    def tensors(self) -> list[torch.Tensor]:
        """What a step reads and writes on the device."""
        return [*self.slots.tensors(), self.count, self.rows_index, self.physical_index]

    def going_on(self, kept: dict[int, int]) -> Group | None:
        """This group for the stack's rows that go on (``kept``: old row -> new row), or None where none of its rows
        does; its buffers as they are (nothing copied)."""
        pairs = [(kept[row], spot) for row, spot in zip(self.rows, self.physical, strict=True) if row in kept]
        if not pairs:
            return None
        return Group(self.slots, self.count, self.most, [row for row, _ in pairs], [spot for _, spot in pairs])


def runs(physical: list[int]) -> list[tuple[int, int, int]]:
    """The runs of consecutive buffer rows in ``physical`` (increasing): (first, end, where the run starts among
    them)."""
    found: list[tuple[int, int, int]] = []
    for mine, spot in enumerate(physical):
        if found and found[-1][1] == spot:
            first, _, at = found[-1]
            found[-1] = (first, spot + 1, at)
        else:
            found.append((spot, spot + 1, mine))
    return found


def attend_chunk_causally(query: torch.Tensor, slots: Slots, start: torch.Tensor, scaling: float) -> torch.Tensor:
    """A chunk's queries [B, Hq, n, D] over held slots whose last n (from ``start`` [B, Hkv] on) are the chunk's own
    tokens: each attends to the slots before the chunk and to the chunk's tokens up to itself, through torch's fused
    attention, each KV head's query heads as query rows of it (:func:`~h2o_eval.decode.attend`)."""
    batch, q_heads, n, dim = query.shape
    kv_heads = slots.keys.shape[1]
    group = q_heads // kv_heads
    columns = torch.arange(slots.width, device=start.device)
    last = start.unsqueeze(-1) + torch.arange(n, device=start.device)  # [B, Hkv, n]: each query's own slot
    mask = slots.held.unsqueeze(2) & (columns <= last.unsqueeze(-1))  # [B, Hkv, n, S]
    grouped = query.reshape(batch, kv_heads, group * n, dim)
    mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(batch, kv_heads, group * n, -1)
    output = torch.nn.functional.scaled_dot_product_attention(
        grouped, slots.keys, slots.values, attn_mask=mask, scale=scaling
    )
    return output.reshape(batch, q_heads, n, dim)


class StackedDecode:
    """The steps of one layer of a stack whose views' layers (none sliding) are settled in a decode layout: their
    rows laid out once, at the stack's first forward, in buffers of its own (the views are left as they were), and
    grouped by how many tokens they hold (rows whose counts round to one bucket), so that each forward (the
    question's chunk, then a token per step) appends and attends in one call per group, not one per view (the views'
    layers then let their slots go: :meth:`~h2o_eval.layer.EvictionLayer.let_go`). Rows
    that leave stay in their group's buffers, unread, and nothing is copied (:meth:`Group.going_on`); a group lays
    out :data:`ROOM` slots beyond a bucket of what it holds and attends the buckets its rows fill
    (:meth:`Group.used`), so that it seldom widens, and a widening copies the rows that go on alone."""

    def __init__(self, groups: list[Group]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, layers: list[EvictionLayer], n: int) -> StackedDecode:
        """The views' layers' slots as they are after their last chunk, each copied once into its group's buffers,
        wide enough for the stack's first forward of ``n`` tokens (read on the host: it is no decode step)."""
        laid: dict[int, list] = {}
        start = 0
        for layer in layers:
            slots = layer.layout.compacted()
            count = slots.held.sum(-1)
            most = int(count.max()) if count.numel() else 0
            if not bool(slots.held[..., :most].all()):  # a head that holds fewer: its held slots first
                slots = slots.held_first(most)
            member = (slots, count, most, list(range(start, start + len(count))))
            laid.setdefault(bucket(most + n), []).append(member)
            start += len(count)
        groups = []
        for width, members in sorted(laid.items()):
            rows = [row for member in members for row in member[3]]
            at = list(itertools.accumulate((len(member[3]) for member in members), initial=0))
            parts = [(member[0].dense(), first, width) for member, first in zip(members, at[:-1], strict=True)]
            buffers = laid_out(parts, len(rows), width + ROOM)
            count = torch.cat([member[1] for member in members])
            groups.append(Group(buffers, count, max(m[2] for m in members), rows, list(range(len(rows)))))
        return cls(groups)

    def prepare(self, n: int) -> None:
        """Before a forward of ``n`` tokens, on the host: every group's buffers wide enough for them."""
        self.groups = [group.prepare(n) for group in self.groups]

    def step(self, query, key, value, positions, scaling) -> torch.Tensor:
        """Device work only (capturable as a CUDA graph, once :meth:`prepare` has run): the chunk's tokens
        appended and attended, group by group."""
        output = torch.empty_like(query)
        for group in self.groups:
            group.step(query, key, value, positions, scaling, output)
        return output

    def advance(self, n: int) -> None:
        """The host's counts after a forward of ``n`` tokens, eager or replayed."""
        for group in self.groups:
            group.most += n

    def tensors(self) -> list[torch.Tensor]:
        return [tensor for group in self.groups for tensor in group.tensors()]

    def rows(self, keep: list[int]) -> StackedDecode:
        """This layer's steps for the stack's rows ``keep`` (increasing), in that order."""
        kept = {row: new for new, row in enumerate(keep)}
        return StackedDecode([group for group in (g.going_on(kept) for g in self.groups) if group is not None])


class StackedLayer(LayersOfCaches):
    """One layer of a :class:`StackedCache`: each cache's rows of a chunk go to that cache's layer, which takes
    them and attends as it would alone; the outputs are the rows in order. Decode steps of layers that do not slide
    go through one :class:`StackedDecode` for all the views instead."""

    def __init__(self, layers: list[EvictionLayer], rows: list[int], decode: StackedDecode | None = None) -> None:
        super().__init__(layers)
        self.is_initialized = True
        ends = list(itertools.accumulate(rows))
        self.rows = [slice(end - count, end) for end, count in zip(ends, rows, strict=True)]
        self.decode = decode
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def _stacked(self) -> bool:
        """Whether the stack's forwards go through one :class:`StackedDecode` here: every view's layer does not slide
        and is settled in a decode layout (it has taken its prompt and compressed it)."""
        return self.decode is not None or all(
            layer.window is None and layer.layout is not None and layer.seen > 0 and layer.shared.rehearsing is None
            for layer in self.layers
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._stacked():
            self.pending = (key_states, value_states)
            return key_states, value_states
        for layer, rows in zip(self.layers, self.rows, strict=True):
            layer.update(key_states[rows], value_states[rows])
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scaling, hidden_states=None) -> torch.Tensor:
        if self.pending is not None:
            return self._attend_stacked(query, key, value, attention_mask, scaling)
        outputs = []
        for layer, rows in zip(self.layers, self.rows, strict=True):
            keys, values = layer.pending
            mask = None if attention_mask is None else attention_mask[rows]
            own = None if hidden_states is None else hidden_states[rows]
            outputs.append(layer.attend(module, query[rows], keys, values, mask, scaling, hidden_states=own))
        return torch.cat(outputs)

    def _attend_stacked(self, query, key, value, attention_mask, scaling) -> torch.Tensor:
        """A forward of every view's layer at once: the views' host counts move as theirs would (a layer's first of
        a forward moves its sequences' positions), the step itself is the stack's. The chunk's tokens are real: a
        stack is fed its question and then a token per step, with no padding."""
        self.pending = None
        n = key.shape[2]
        arriving = key_validity(attention_mask, key.shape[0], n, key.device)
        positions = []
        for layer, rows in zip(self.layers, self.rows, strict=True):
            if layer.seen == layer.shared.columns:
                layer.shared.begin(arriving[rows], decode=n == 1)
            layer.seen += n
            positions.append(layer.shared.last.view(-1, 1) - torch.arange(n - 1, -1, -1, device=key.device))
        if self.decode is None:
            self.decode = StackedDecode.of(self.layers, n)
            for layer in self.layers:  # the stack decodes in its own buffers from now on
                layer.let_go()
        self.decode.prepare(n)
        output = self.decode.step(query, key, value, torch.cat(positions), scaling)
        self.decode.advance(n)
        return output

    def advance(self) -> None:
        """The host's counts after a replayed decode step, as :meth:`_attend_stacked` moves them."""
        for layer in self.layers:
            layer.seen += 1
        self.decode.advance(1)

    def check_attended(self) -> None:
        if self.pending is not None:
            raise RuntimeError("a stacked layer's keys never reached the h2o_eval attention backend")
        super().check_attended()


class StackedCache(Cache):
    """One cache whose sequences are those of ``views`` in order (compressed caches under ``decoding=grow``, as
    :meth:`~h2o_eval.cache.EvictionCache.grown_view` s, all fed the same tokens), for feeding them the same tokens
    in one batch. Each layer hands each cache's rows to that cache's layer, which attends to what it holds as it
    would alone, over its own slots only; what is batched is the rest of the model. The caches the views were made
    of are left as they were."""

    deferred = False

    def __init__(self, views: list[Any], decodes: list[StackedDecode | None] | None = None) -> None:
        if len({tuple(layer.seen for layer in view.layers) for view in views}) != 1:
            raise ValueError("the caches have seen different tokens: only caches fed the same tokens are stacked")
        rows = [len(view.lengths) for view in views]
        decodes = decodes or [None] * len(views[0].layers)
        super().__init__(
            layers=[
                StackedLayer([view.layers[i] for view in views], rows, decodes[i]) for i in range(len(views[0].layers))
            ]
        )
        self.views = views
        self.lengths = [length for view in views for length in view.lengths]
        graphs = views[0].graphs  # the views' own graphs (their copies' alike): the stack captures steps of its own
        self.graphs = None if graphs is None else graphs.fresh()

    def eviction_layer(self, layer: int) -> StackedLayer:
        return self.layers[layer]

    def rows(self, keep: list[int]) -> StackedCache:
        """These caches' sequences ``keep`` (increasing indices over the stack) stacked again, to go on with those
        alone: a view that keeps all its sequences goes on as it is (this stack is not fed again), one that keeps
        some goes on as a :meth:`~h2o_eval.cache.EvictionCache.fork` of them, and one that keeps none leaves."""
        views, start = [], 0
        for view in self.views:
            count = len(view.lengths)
            if own := [row - start for row in keep if start <= row < start + count]:
                views.append(view if len(own) == count else view.fork(own))
            start += count
        return StackedCache(views, [None if layer.decode is None else layer.decode.rows(keep) for layer in self.layers])

    def check_attended(self) -> None:
        for layer in self.layers:
            layer.check_attended()

    def check_faults(self) -> None:
        for view in self.views:
            view.check_faults()

    # -- decode steps as CUDA graphs (h2o_eval.graphs): the stack's StackedDecode is their state ---------------------

    def capturable(self, batch: int) -> bool:
        """Whether the next one-token forward of ``batch`` sequences can be captured: every layer decodes through
        its StackedDecode (laid out by the stack's first forward; none where a layer slides)."""
        return batch == len(self.lengths) and all(layer.decode is not None for layer in self.layers)

    def prepare_decode(self) -> None:
        for layer in self.layers:
            layer.decode.prepare(1)

    def buffers(self) -> tuple:
        """What a captured step reads and writes, by address: a step captured for other buffers does not fit."""
        tensors = [*(t for view in self.views for t in (view.shared.last, view.shared.real)), *self._decoded()]
        used = tuple(group.used(1) for layer in self.layers for group in layer.decode.groups)
        return (*(None if t is None else (t.data_ptr(), tuple(t.shape)) for t in tensors), used)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a step may read without owning it (:class:`~h2o_eval.graphs.RecordedGraph`)."""
        return [*(t for view in self.views for t in view.shared.tensors()), *self._decoded(), *CONSTANTS.values()]

    def _decoded(self) -> list[torch.Tensor]:
        return [tensor for layer in self.layers for tensor in layer.decode.tensors()]

    def host_state(self) -> list[tuple[object, dict]]:
        groups = [group for layer in self.layers for group in layer.decode.groups]
        views = [part for view in self.views for part in (view.shared, *view.layers)]
        return host_state([*views, *groups])

    restore_host_state = staticmethod(restore_host_state)

    def advance(self) -> None:
        for view in self.views:
            view.shared.advance()
        for layer in self.layers:
            layer.advance()


class SharedPromptLayer(LayersOfCaches):
    """One layer of :class:`SharedPrompt`: the chunk goes to every cache's layer, attention is computed once."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if any(layer.seen for layer in self.layers):
            raise RuntimeError("SharedPrompt feeds the first chunk of empty caches only")
        return [layer.update(key_states, value_states) for layer in self.layers][0]

    def attend(self, module, query, key, value, attention_mask, scaling, hidden_states=None) -> torch.Tensor:
        votes: list = []  # prompt votes the caches' rules weigh alike are computed once (Chunk.votes)
        shared: dict = {}  # and what their scorers compute of the prompt alone (Prompt.once)
        for layer in self.layers:
            layer.attend(
                module, query, key, value, attention_mask, scaling, output=False, hidden_states=hidden_states,
                votes=votes, shared=shared,
            )  # fmt: skip
        return plain_attention(module, query, key, value, attention_mask, scaling)


class SharedPrompt(Cache):
    """Feeds one first chunk (a prompt, or a context) to several empty :class:`~h2o_eval.cache.EvictionCache` s of
    one model at once. In the ``prefill`` and ``context`` protocols that chunk attends in full whatever the policy,
    so its attention is computed once (as the full cache computes it), while each cache scores and compresses it by
    its own policy; the caches then go on alone. Decoding through a ``SharedPrompt`` is refused: the policies part
    there."""

    def __init__(self, caches: list[Any]) -> None:
        if any(cache.protocol == "simulate" for cache in caches):
            raise ConfigError("simulate scores every row under eviction: its first chunk cannot be shared")
        super().__init__(
            layers=[SharedPromptLayer(list(layers)) for layers in zip(*(c.layers for c in caches), strict=True)]
        )

    def eviction_layer(self, layer: int) -> SharedPromptLayer:
        return self.layers[layer]

    def check_attended(self) -> None:
        for layer in self.layers:
            layer.check_attended()
