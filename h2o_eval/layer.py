"""One layer of an :class:`~h2o_eval.cache.EvictionCache`: what it holds, and the named step each chunk takes.

A layer holds :class:`~h2o_eval.decode.Slots`: keys/values [B, Hkv, S, D] and per slot whether it is ``held``, the
``position`` of its token and its ``score``. Each forward hands the layer a chunk of new tokens (``update``, then
``attend``), and the chunk takes one of these steps:

- ``chunk``: the mechanism (:attr:`~h2o_eval.implementation.Implementation.chunk`) over the held slots and the
  chunk: a prompt is attended in full, scored and compressed; later rows arrive under the policy's decoding rule.
  A chunk that can evict nothing is plain attention, and a deferred prompt (one scored by extra passes) is held
  whole.
- ``decode``: one token per sequence through the layer's decode layout (:mod:`h2o_eval.layouts`: ``Bounded``,
  ``Dense`` or ``Ragged``), chosen once when the layer settles after a chunk or a compression
  (:meth:`EvictionLayer.settle`), and wrapped under ``decoding=interval`` (:class:`~h2o_eval.interval.Intervals`:
  the steps counted, the compressions made when due). Under a threshold that drops, what left the window below it is
  freed after the step (:func:`~h2o_eval.decode.drop`).
- ``window``: a sliding layer of a model that also has global layers keeps its last ``window`` - 1 tokens, as
  transformers' own sliding cache does, and the policy does not touch it.
- ``rehearse``: an extra pass over a deferred prompt (KVzip's repeat): it attends, scores the held slots, and its
  own keys and values are dropped again.

A decode step never reads a value on the host, never allocates state and takes its shapes from the buffers, so it
can be captured as a CUDA graph and replayed (:mod:`h2o_eval.graphs`); its host counts move in
:meth:`EvictionLayer.advance`, for eager and replayed steps alike. What a step must refuse (a padding token after the
prompt, an inconsistent plan) is noted on the device and raised when the cache is next read
(:meth:`EvictionLayer.faults`).

A layer reads what its cache fixed once in a frozen :class:`~h2o_eval.context.LayerContext` (policy, rule,
implementation, window, protocol) and shares with the cache's other layers one :class:`~h2o_eval.context.Sequences`
(the sequences' lengths and positions); it knows nothing else of its cache.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import CacheLayerMixin

from h2o_eval.attention import check_kv_heads, check_window, key_validity, plain_attention
from h2o_eval.compression import compress
from h2o_eval.context import LayerContext, Plan, Sequences, arriving_scores, first_plan, plan_tensors, starting_scores
from h2o_eval.decode import Slots, bucket
from h2o_eval.eviction import Chunk
from h2o_eval.interval import Intervals, Steps, Turn, between, compression, turn_compression
from h2o_eval.layouts import Binding, Bounded, DecodeLayout, Dense, Ragged
from h2o_eval.policies import UNBOUNDED
from h2o_eval.policies.inputs import Prompt, Rehearsal
from h2o_eval.rerotation import rerotated


class EvictionLayer(CacheLayerMixin):
    """One layer's bounded cache (see the module): its slots, the capacity per (sequence, KV head) of its ``plan``,
    and the host counts its decode steps go by. Heads may hold different numbers of tokens (Ada-KV).

    ``is_sliding`` stays False even for a sliding layer: transformers then builds masks over every position seen,
    so the last columns of any layer's mask are the slots it holds."""

    is_sliding = False
    is_croppable = False

    def __init__(self, context: LayerContext, shared: Sequences, layer_idx: int, window: int | None = None) -> None:
        self.is_initialized = False  # CacheLayerMixin's own __init__ would assign keys and values, which are slots'
        self.context, self.shared, self.layer_idx, self.window = context, shared, layer_idx, window
        self._slots: Slots | None = None  # the state while no layout owns it
        self.scaling = 1.0  # the attention's logit scale, as its module gave it
        self.seen = 0  # columns fed, padding included
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys/values ``update`` took
        self.plan: Plan | None = None
        self.moved = False  # whether slots stopped being the model's own positions (an eviction or compaction)
        self.kept: torch.Tensor | None = None  # [B, Hkv] tokens held right after the prompt was compressed
        self.rehearsed: torch.Tensor | None = None  # [B, Hkv, S] the compression scores of a deferred prompt
        self.peak = 0  # the most tokens any head held when last settled
        # How one token per sequence is decoded (Bounded, Dense or Ragged), chosen when the layer settles; None
        # while there is nothing to decode into (no plan, a deferred prompt, a sliding layer's own window).
        self.layout: DecodeLayout | None = None
        # decoding=interval: the forwards since the last compression (None under another decoding: no step asks)
        self.steps = None if context.interval is None else Steps(context.interval)
        # protocol=turns: the attention inputs fed since the last turn's compression (None: nothing recorded)
        self.turn: Turn | None = None

    @property
    def recorders(self) -> tuple[Steps, ...]:
        """What records each forward's attention input before the layer attends it: interval's steps, a turn's."""
        return tuple(steps for steps in (self.steps, self.turn) if steps is not None)

    # -- the state, as transformers and the tests read it ------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.slots = Slots.empty(key_states, value_states)
        self.is_initialized = True

    @property
    def slots(self) -> Slots | None:
        """The state: its decode layout's slots while one decodes, else the layer's own."""
        return self._slots if self.layout is None else self.layout.slots

    @slots.setter
    def slots(self, slots: Slots | None) -> None:
        """A new state, the layer's own until :meth:`settle` lays it out anew."""
        self.layout, self._slots = None, slots

    @property
    def keys(self) -> torch.Tensor:
        """[B, Hkv, S, D], gathered from a ragged layout's rows."""
        return self.slots.dense().keys

    @property
    def values(self) -> torch.Tensor:
        return self.slots.dense().values

    def kv_bytes(self) -> int:
        """Bytes of the keys and values this layer has allocated (a growing layer's spare slots included)."""
        return 2 * self.slots.keys.numel() * self.slots.keys.element_size() if self.is_initialized else 0

    held = property(lambda self: self.slots.held, doc="[B, Hkv, S] bool: the slots that hold a token")
    position = property(lambda self: self.slots.position, doc="[B, Hkv, S]: each slot's token's position")
    scores = property(lambda self: self.slots.scores, doc="[B, Hkv, S] float32: each slot's score")

    # -- update: the chunk's keys and values ---------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.check_attended()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        shared = self.shared
        if shared.deferred and self.seen and shared.rehearsing is None:
            raise RuntimeError(
                f"policy {self.context.policy.name!r} compresses its prompt after extra passes, not yet run: call "
                "h2o_eval.compress(model, cache, tokenizer, input_ids) after the prompt, before feeding more tokens"
            )
        self.pending = (key_states, value_states)
        return self.pending

    def _step(self, key_states: torch.Tensor) -> str:
        if self.shared.rehearsing is not None:
            return "rehearse"
        if self.window is not None:
            return "window"
        if key_states.shape[2] > 1 or self.seen == 0 or self.layout is None:
            return "chunk"
        return "decode"

    def check_attended(self) -> None:
        """Refuse to go on when the keys this layer took never reached the backend's attention."""
        if self.pending is not None:
            raise RuntimeError(
                f"layers [{self.layer_idx}] did not run through the h2o_eval attention backend: this model cannot "
                "be evaluated with eviction (refusing to report unpatched numbers)"
            )

    # -- attend: the step's attention and the state after it -----------------------------------------------------

    def attend(
        self,
        module,
        query,
        key,
        value,
        attention_mask,
        scaling,
        output: bool = True,
        hidden_states=None,
        votes=None,
        shared=None,
    ) -> torch.Tensor | None:
        """This layer's attention for the chunk ``update`` took, and the cache state after it. Without ``output`` (a
        :class:`~h2o_eval.groups.SharedPrompt` pass, which computes the prompt's attention once) only the state is
        computed, and None returned. ``hidden_states``: the attention module's input (a scorer may read it).
        ``votes``: the prompt votes the other caches of that pass computed (:attr:`~h2o_eval.eviction.Chunk.votes`);
        ``shared``: what their scorers computed of the prompt (:meth:`~h2o_eval.policies.inputs.Prompt.once`)."""
        self.pending = None
        check_kv_heads(module, query, key, self.context.kv_heads)
        step = self._step(key)
        arriving = key_validity(attention_mask, key.shape[0], query.shape[2], key.device)
        if step == "rehearse":
            return self._rehearse(module, query, key, value, attention_mask, scaling, arriving, hidden_states)
        self.scaling = scaling
        if step == "decode":  # the layout's host work (under decoding=interval first a compression when due)
            self.layout.prepare()
        elif self.steps is not None and between(self):  # decoding=interval: a compression due before this chunk
            self.compress_held()
        for recorder in self.recorders:
            recorder.record(self, module, hidden_states, scaling, arriving.shape[1])
        if self.seen == self.shared.columns:  # the first layer this forward reaches
            self.shared.begin(arriving, decode=arriving.shape[1] == 1 and self.seen > 0)
        check_window(self.context.window, self.shared.longest)
        if step == "decode":
            result = self.layout.step(query, key, value)
            self.advance()
            return result
        if self.seen and self.steps is not None:
            self.steps.fed(arriving.shape[1])
        self.seen += arriving.shape[1]
        if step == "window":
            result = self._attend_window(module, query, key, value, attention_mask, scaling, arriving, output)
        else:
            result = self._attend_chunk(
                module, query, key, value, attention_mask, scaling, arriving, output, hidden_states, votes, shared
            )
        self.settle()
        return result

    def dropped(self, output=None):
        """End a forward (returns ``output``): a rule that drops frees what left the window below its threshold."""
        return self._binding().dropped(self.slots, output)

    def advance(self) -> None:
        """The host's counts after a decode step, eager or replayed (:mod:`h2o_eval.graphs`): where they move."""
        self.seen += 1
        self.layout.advance()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps on the device: what a captured decode step may read (h2o_eval.graphs)."""
        kept = [self.kept, self.rehearsed, *([] if self.layout is None else self.layout.tensors())]
        kept += [] if self.plan is None else [self.plan.capacity, self.plan.recent, self.plan.sinks]
        kept += [] if self.slots is None else list(self.slots.tensors())
        return [tensor for tensor in kept if tensor is not None]

    def buffers(self) -> tuple:
        """What a captured decode step of this layer reads and writes, by address: a step captured for other
        buffers does not fit these."""
        tensors = [*self.slots.tensors(), *self.layout.tensors(), self.plan.recent, self.plan.sinks]
        return (type(self.layout), *(None if t is None else (t.data_ptr(), tuple(t.shape)) for t in tensors))

    def capturable(self) -> bool:
        """Whether this layer's next one-token step is a decode step that can be captured (:mod:`h2o_eval.graphs`)."""
        ready = self.window is None and self.layout is not None and self.seen > 0 and self.pending is None
        return ready and self.turn is None

    def prepare_decode(self) -> None:
        """Before a replayed decode step, on the host: its layout's :meth:`~h2o_eval.layouts.DecodeLayout.prepare`
        (buffers wide enough for one more token, the position scores ahead; under ``decoding=interval`` first the
        compression its counts say is due)."""
        if self.layout is not None:
            self.layout.prepare()

    def _attend_chunk(
        self, module, query, key, value, attention_mask, scaling, arriving, output, hidden_states, votes, shared
    ):
        """A chunk through the mechanism: the first one fixes the layer's plan and may be a prompt."""
        context, sequences = self.context, self.shared
        slots = self._compacted()
        batch, kv_heads, n = key.shape[0], key.shape[1], query.shape[2]
        first = self.seen == n
        if first:
            self.plan = first_plan(context, self.shared, self.layer_idx, arriving)
            if (own := context.policy.attention(query, key, value, arriving, scaling)) is not None:
                self._keep_all(key, value, arriving)
                return own
        new_position = sequences.positions(arriving).unsqueeze(1).expand(batch, kv_heads, n)
        # A first chunk's keys and values are held as they arrive, not copied (a SharedPrompt's caches then share
        # them): nothing writes into a state in place until a layout or a compression has made it anew.
        keys, values = (
            (key, value)
            if not slots.width
            else (torch.cat([slots.keys, key], -2), torch.cat([slots.values, value], -2))
        )
        if first and sequences.deferred or not self.moved and self._evicts_nothing(first, arriving):
            fresh = arriving_scores(context, key, new_position, self.layer_idx)
            self.dropped(self._keep_all(keys, values, arriving, new_position, fresh))  # a deferred prompt: after passes
            return plain_attention(module, query, keys, values, attention_mask, scaling) if output else None
        position = torch.cat([slots.position, new_position], dim=-1).contiguous()
        fresh = starting_scores(context.policy, key, new_position, self.layer_idx)
        prefill = context.prompt_rows(arriving) if first else torch.zeros(batch, dtype=torch.int64, device=key.device)
        rescore = None
        if first and context.policy.rescores:
            rows = torch.arange(n, device=key.device)
            prompt = Prompt(
                module=module,
                layer=self.layer_idx,
                query=query,
                key=key,
                value=value,
                position=new_position[:, 0],
                real=arriving & (rows < prefill.view(-1, 1)),
                capacity=self.plan.capacity,
                hidden_states=hidden_states,
                rotary=None if context.rotary is None else (lambda p: context.rotary(self.layer_idx, p)),
                scaling=scaling,
                shared=shared,
            )

            def rescore(scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
                found = context.policy.compression_scores(prompt, scores, protected)
                return scores if found is None else found.float()

        chunk = Chunk(
            held=torch.cat([slots.held, torch.zeros(batch, kv_heads, n, dtype=torch.bool, device=key.device)], -1),
            arriving=arriving,
            position=position,
            scores=torch.cat([slots.scores, fresh], dim=-1),
            capacity=self.plan.capacity,
            recent=self.plan.recent,
            sinks=self.plan.sinks,
            prefill=prefill,
            rule=context.rule,
            scaling=scaling,
            output=output,
            rescore=rescore,
            votes=votes,
        )
        result = context.implementation.chunk(query, keys, values, chunk)
        self.plan = self.plan.with_capacity(result.capacity)
        if result.kept is not None:
            self.kept = result.kept
        entered = torch.cat([slots.held, arriving.unsqueeze(1).expand(batch, kv_heads, n)], dim=-1)
        self._keep(Slots(keys, values, result.held, position, result.scores), entered)
        if result.kept is not None:  # a prompt was compressed: the policy may turn the keys it kept
            self.slots = rerotated(self.slots, self.shared.last, context.rerotation, self.layer_idx)
        return self.dropped(result.output)

    def _compacted(self) -> Slots:
        """The state a chunk starts from: the slots filled so far (not a growing layer's spare room), in the dense
        layout."""
        return self.slots if self.layout is None else self.layout.compacted()

    def _keep(self, slots: Slots, entered: torch.Tensor) -> None:
        """The state after a chunk: its slots as they are if nothing left, else only the held slots (per head,
        padded to the fullest head)."""
        if not torch.equal(slots.held, entered):
            self.moved = True
            slots = slots.held_first(int(slots.held.sum(-1).max()))
        self.slots = slots

    def _rehearse(self, module, query, key, value, attention_mask, scaling, arriving, hidden_states) -> torch.Tensor:
        """An extra pass (:meth:`EvictionCache.rehearsal`): its tokens attend to the held slots and to each other,
        the policy scores the slots by what the pass shows it, and the pass's keys and values are dropped (the
        state stays the prompt's). A sliding layer only attends."""
        slots = self.slots
        keys, values = torch.cat([slots.keys, key], -2), torch.cat([slots.values, value], -2)
        mask = None if attention_mask is None else attention_mask[..., -keys.shape[2] :]
        rehearsal = None
        if self.window is None:
            sequences = self.shared
            rehearsal = Rehearsal(
                index=sequences.rehearsing,
                script=sequences.script,
                module=module,
                layer=self.layer_idx,
                query=query,
                key=keys,
                value=values,
                held=slots.held,
                position=slots.position,
                real=arriving,
                scaling=scaling,
                hidden_states=hidden_states,
            )
            before = torch.zeros_like(slots.scores) if self.rehearsed is None else self.rehearsed
            self.rehearsed = self.context.policy.rehearse(rehearsal, before).float()
        if rehearsal is not None and rehearsal.output is not None:  # the scorer's attention was the pass's
            return rehearsal.output
        return plain_attention(module, query, keys, values, mask, scaling)

    def compress_prompt(self, capacity: torch.Tensor) -> None:
        """Compress a deferred prompt (after its extra passes) to ``capacity`` [B, Hkv] by the scores the passes
        gave it, as a prompt is compressed (:func:`h2o_eval.compression.compress`)."""
        if self.window is not None:
            return
        slots, plan = self.slots, self.plan
        scores = slots.scores if self.rehearsed is None else self.rehearsed
        held, scores, after = compress(
            slots.held, scores, slots.position, capacity, plan.recent, plan.sinks,
            self.shared.last.view(-1), self.context.rule,
        )  # fmt: skip
        self.plan, self.kept, self.rehearsed = plan.with_capacity(after), held.sum(-1), None
        self._keep(Slots(slots.keys, slots.values, held, slots.position, scores), slots.held)
        self.slots = rerotated(self.slots, self.shared.last, self.context.rerotation, self.layer_idx)
        self.settle()

    def _evicts_nothing(self, first: bool, arriving: torch.Tensor) -> bool:
        """Whether this chunk is plain attention: nothing is ever evicted (an unbounded capacity), or, for a cache
        that sees one chunk only (:func:`h2o_eval.backend.patch`), C covers what could overflow it (the prompt for
        a policy that grows after it, else every token)."""
        capacity = self.plan.capacity
        if self.plan.unbounded:
            return True
        context = self.context
        if not (first and context.one_forward) or context.rule.threshold is not None:
            return False
        lengths = self.shared.lengths
        limit = torch.tensor(lengths, device=capacity.device) if context.rule.grows else arriving.sum(-1)
        return bool((capacity >= limit.view(-1, 1)).all())

    def _keep_all(self, key, value, arriving, new_position=None, fresh=None) -> None:
        """Hold every arriving token (a chunk that evicts nothing) of ``key``/``value`` (the state's slots and the
        chunk's); their scores are ``fresh`` [B, Hkv, n], or 0 where nothing reads them."""
        slots = self._compacted()
        batch, kv_heads, n = key.shape[0], key.shape[1], arriving.shape[1]
        position = slots.position if new_position is None else torch.cat([slots.position, new_position], dim=-1)
        if position.shape[-1] < key.shape[2]:  # a policy that computes its own attention keeps no positions
            position = torch.cat([position, position.new_zeros(batch, kv_heads, n)], dim=-1)
        self.slots = Slots(
            key,
            value,
            torch.cat([slots.held, arriving.unsqueeze(1).expand(batch, kv_heads, n)], dim=-1),
            position,
            torch.cat([slots.scores, slots.scores.new_zeros(batch, kv_heads, n) if fresh is None else fresh], dim=-1),
        )

    def _attend_window(self, module, query, key, value, attention_mask, scaling, arriving, output=True):
        """The model's own sliding-window attention over the slots held (the mask's last columns), then keep the
        last ``window`` - 1 slots."""
        slots = self.slots
        keys, values = torch.cat([slots.keys, key], -2), torch.cat([slots.values, value], -2)
        if slots.width:
            self.shared.note_padding(arriving)
        mask = None if attention_mask is None else attention_mask[..., -keys.shape[2] :]
        result = plain_attention(module, query, keys, values, mask, scaling) if output else None
        keep = min(keys.shape[2], self.window - 1)
        batch, kv_heads = keys.shape[:2]
        self.slots = Slots(
            keys[:, :, keys.shape[2] - keep :],
            values[:, :, values.shape[2] - keep :],
            torch.ones(batch, kv_heads, keep, dtype=torch.bool, device=keys.device),
            torch.zeros(batch, kv_heads, keep, dtype=torch.int64, device=keys.device),
            torch.zeros(batch, kv_heads, keep, dtype=torch.float32, device=keys.device),
        )
        return result

    def settle(self) -> None:
        """After a chunk or a compression (where reading the device is allowed): the peak so far, and the layout the
        next decode steps go by (:mod:`h2o_eval.layouts`), with its host counts."""
        slots = self.slots
        held = slots.held.sum(-1)
        most = int(held.max()) if held.numel() else 0
        self.peak = max(self.peak, most)
        self.slots = slots
        if self.window is not None or self.plan is None or self.shared.deferred:
            return
        bound = self._binding()
        if not self.plan.unbounded:
            self.moved = True
            layout = Bounded(slots, bound, most)
        elif held.numel() and (self.context.rule.drops or bool((held.amax(-1) > held.amin(-1)).any())):
            room = bucket(most + 1) - most if self.context.rule.drops else 0  # its regrowths read the device
            layout = Ragged(slots, bound, held.tolist(), room)  # heads as they are
        else:
            layout = Dense(slots, bound, most)
        if self.steps is not None:  # decoding=interval: the layout wrapped, counting its steps
            layout = Intervals(layout, self.steps, self._compressed_if_due)
        self._slots, self.layout = None, layout  # the layout owns the state now

    def _binding(self) -> Binding:
        """What a layout made now binds of this layer."""
        return Binding(self.context, self.shared, self.plan, self.layer_idx, self.scaling)

    def faults(self) -> list[str]:
        """What decode steps noted on the device (reading it waits for the device): a full head whose every held
        token was protected."""
        return [] if self.layout is None else self.layout.faults()

    def compress_held(self) -> None:
        """``decoding=interval``: compress what this layer holds to the target by its decoding policy's scores
        (:func:`~h2o_eval.interval.compression`), as a prompt is compressed."""
        slots = self._compacted()
        kept, scores = compression(self.steps, self.context, self.layer_idx, self.seen, slots)
        if self.layout is not None:
            self.peak = max(self.peak, self.layout.most)
        self._keep(Slots(slots.keys, slots.values, kept, slots.position, scores), slots.held)
        self.settle()
        self.steps.reset()

    def _compressed_if_due(self) -> bool:
        """``decoding=interval``, before a decode step: whether its counts said a compression was due, and if so the
        layer compressed (:meth:`compress_held`) and its new layout prepared."""
        if not between(self):
            return False
        self.compress_held()
        self.layout.prepare()
        return True

    def compress_turn(self, since: torch.Tensor | None) -> None:
        """``protocol=turns``: compress what this layer holds after a turn, as kvpress's press compresses the cache it
        holds by the queries of what was fed since (:func:`~h2o_eval.interval.turn_compression`, over the attention
        inputs :attr:`turn` recorded). ``since`` None (``nested``): every held token is a candidate; else [B] the
        first position of the new turn (``new_turn``): only the tokens from there are, and the older ones keep their
        slots, keys, values and scores untouched. A sliding layer keeps its own window."""
        steps, self.turn = self.turn, None
        if self.window is not None or steps is None:
            return
        slots = self._compacted()
        held, scores = turn_compression(steps, self.context, self.layer_idx, slots, since)
        self._keep(Slots(slots.keys, slots.values, held, slots.position, scores), slots.held)
        self.settle()

    def let_go(self) -> None:
        """Hold no keys or values any more (a stack laid them out in buffers of its own and decodes there,
        :class:`~h2o_eval.groups.StackedDecode`): empty slots of the same sequences and heads, so that what this layer
        held is freed where nothing else holds it; its host counts stay."""
        self.slots = self.slots.map(lambda tensor: tensor.new_empty((*tensor.shape[:2], 0, *tensor.shape[3:])))

    def adopt_rehearsal(self, other: EvictionLayer) -> None:
        """Take the scores ``other``'s extra passes gave the same deferred prompt
        (:meth:`~h2o_eval.cache.EvictionCache.adopt_rehearsal`)."""
        if self.window is not None:
            return
        if not (torch.equal(self.held, other.held) and torch.equal(self.position, other.position)):
            raise ValueError("the caches hold different prompts: extra passes are shared by one prompt's caches")
        self.rehearsed = None if other.rehearsed is None else other.rehearsed.clone()

    # -- copies ----------------------------------------------------------------------------------------------------

    def _sibling(self, context: LayerContext, shared: Sequences) -> EvictionLayer:
        """A new layer of this one's index and window under ``context`` and ``shared``, with its counts of what was
        fed (its state is the caller's to give)."""
        layer = EvictionLayer(context, shared, self.layer_idx, self.window)
        layer.seen, layer.moved, layer.is_initialized, layer.peak, layer.scaling = (
            self.seen,
            self.moved,
            self.is_initialized,
            self.peak,
            self.scaling,
        )
        return layer

    def fork(self, context: LayerContext, shared: Sequences, rows: list[int], full: bool = False) -> EvictionLayer:
        """A copy of this layer's state for sequences ``rows`` (indices), under ``context`` and ``shared``; ``full``:
        under the plan of ``context``'s policy (the full cache's, :meth:`EvictionCache.full_copy`), nothing evicted."""
        if self.pending is not None:
            raise RuntimeError("a cache can be forked between forwards only")
        layer = self._sibling(context, shared)
        if self.slots is not None:
            layer.slots = self._compacted().rows(rows)
        layer.steps = self.steps.rows_of(rows) if layer.steps is not None and self.steps is not None else layer.steps
        index = None if self.slots is None else torch.tensor(rows, device=self.slots.held.device)
        layer.kept = None if self.kept is None else self.kept[index]
        layer.rehearsed = None if self.rehearsed is None else self.rehearsed[index]
        if self.plan is not None and full:
            plan = plan_tensors(context.policy, shared.lengths, self.layer_idx, context, shared, index.device)
            layer.plan = dataclasses.replace(plan, unbounded=True)
        elif self.plan is not None:
            layer.plan = self.plan.rows(index, shared)
        if layer.is_initialized:
            layer.settle()
        return layer

    def grown_view(self, context: LayerContext, shared: Sequences) -> EvictionLayer:
        """This layer's state, not copied, under ``context`` (:meth:`EvictionCache.grown_view`): tokens fed through
        the view go to buffers of its own (its first append widens a state cut to what is filled), so this layer
        is left as it was."""
        if self.pending is not None:
            raise RuntimeError("a view of a cache is made between forwards only")
        layer = self._sibling(context, shared)
        layer.kept = self.kept
        layer.slots = self._compacted()
        if self.plan is not None:  # a chunk through the view sets its own
            layer.plan = dataclasses.replace(self.plan, unbounded=True)
            if self.window is None:
                most = 0 if self.layout is None else self.layout.most
                layer.layout, layer._slots = Dense(layer.slots, layer._binding(), most), None
        return layer

    def realised(self, lengths: torch.Tensor) -> torch.Tensor:
        """[B, Hkv] the capacity this layer realised per sequence and KV head, at most the length the budget
        applied to: the tokens kept when the prompt was compressed (or the plan's C); a sliding layer that keeps
        its own window counts as min(length, window)."""
        if self.window is not None:
            return lengths.clamp(max=self.window).float().view(-1, 1).expand(-1, self.slots.held.shape[1])
        planned = self.plan.capacity.clamp(max=UNBOUNDED - 1)
        kept = planned if self.kept is None else torch.minimum(self.kept, planned)
        return torch.minimum(kept, lengths.clamp(min=1).view(-1, 1)).float()

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("EvictionCache is not reset: make a new one")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictionCache does not support beam search")
