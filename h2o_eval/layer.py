"""One layer of an :class:`~h2o_eval.cache.EvictionCache`: what it holds, and the named step each chunk takes.

A layer holds :class:`~h2o_eval.decode.Slots`: keys/values [B, Hkv, S, D] and per slot whether it is ``held``, the
``position`` of its token and its ``score``. Each forward hands the layer a chunk of new tokens (``update``, then
``attend``), and the chunk takes one of these steps:

- ``chunk``: the mechanism (:attr:`~h2o_eval.implementation.Implementation.chunk`) over the held slots and the
  chunk: a prompt is attended in full, scored and compressed; later rows arrive under the policy's decoding rule.
  A chunk that can evict nothing is plain attention, and a deferred prompt (one scored by extra passes) is held
  whole.
- ``claim``: one decode token per sequence into a bounded cache: it takes a free slot or its victim's, in place
  (:func:`~h2o_eval.decode.claim`); the attention and, for a rule that scores while decoding, the scores come from
  the decode-attention kernel, else from torch's fused attention over the held slots.
- ``append``: one decode token per sequence into a cache that can no longer evict: it goes into the next slot of
  buffers that grow in buckets (:func:`~h2o_eval.decode.append`), and attends through torch's fused attention
  (under a threshold that drops, what left the window below it is freed after: :func:`~h2o_eval.decode.drop`).
- ``window``: a sliding layer of a model that also has global layers keeps its last ``window`` - 1 tokens, as
  transformers' own sliding cache does, and the policy does not touch it.
- ``rehearse``: an extra pass over a deferred prompt (KVzip's repeat): it attends, scores the held slots, and its
  own keys and values are dropped again.

A decode step (``claim``, ``append``) never reads a value on the host, never allocates state and takes its shapes
from the buffers, so it can be captured as a CUDA graph and replayed (:mod:`h2o_eval.graphs`): what it must know
(how wide the buffers are) is settled on the host between chunks (:meth:`EvictionLayer.prepare_decode`), and what it
must refuse (a padding token after the prompt, an inconsistent plan) is noted on the device and raised when the
cache is next read (:meth:`EvictionLayer.faults`).

A layer reads what its cache fixed once in a frozen :class:`~h2o_eval.context.LayerContext` (policy, rule,
implementation, window, protocol) and shares with the cache's other layers one :class:`~h2o_eval.context.Sequences`
(the sequences' lengths and positions); it knows nothing else of its cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from h2o_eval.attention import check_kv_heads, check_window, key_validity, plain_attention
from h2o_eval.compression import compress
from h2o_eval.context import LayerContext, Sequences, arriving_scores, first_plan, starting_scores
from h2o_eval.decode import Slots, append, append_ragged, attend, bounded, bucket, claim, drop, ragged, widened
from h2o_eval.eviction import Chunk
from h2o_eval.interval import Steps, between
from h2o_eval.policies import UNBOUNDED
from h2o_eval.policies.base import DecodeVote
from h2o_eval.policies.inputs import Prompt, Rehearsal
from h2o_eval.rerotation import rerotated

AHEAD = 64  # decode positions whose position scores are made at once (Policy.position_scores)


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
        self.slots: Slots | None = None
        self.seen = 0  # columns fed, padding included
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys/values ``update`` took
        self.plan: dict[str, torch.Tensor] | None = None
        self.moved = False  # whether slots stopped being the model's own positions (an eviction or compaction)
        self.kept: torch.Tensor | None = None  # [B, Hkv] tokens held right after the prompt was compressed
        self.rehearsed: torch.Tensor | None = None  # [B, Hkv, S] the compression scores of a deferred prompt
        self.unbounded = False  # whether no (sequence, KV head) can evict any more: the cache only grows
        # Host counts the decode steps go by (settled after each chunk): an upper bound on the tokens any head
        # holds, the largest capacity, the slots filled by appends, whether any head has sinks, and the peak.
        self.most = 0
        self.largest = 0
        self.filled = 0
        self.sinks = False
        self.peak = 0
        self.fill: torch.Tensor | None = None  # [1] the next append's slot, on the device
        # A ragged layout (decode.ragged): each head's next slot [B, Hkv] on the device, and the slots left in the
        # room every head has.
        self.count: torch.Tensor | None = None
        self.room_left = 0
        self.counts: list[list[int]] = []  # per sequence and KV head, the tokens held when last laid out
        self.grown = 0  # tokens appended since
        self.worst: torch.Tensor | None = None  # [B, Hkv, 1] the highest lowest-candidate score of any claim
        # A policy's position scores for the next AHEAD positions from ahead_base [B, 1, 1], for claims to read.
        self.ahead: torch.Tensor | None = None
        self.ahead_base: torch.Tensor | None = None
        self.ahead_left = 0
        self.steps = Steps(context.interval)  # decoding=interval: the forwards since the last compression

    # -- the state, as transformers and the tests read it ------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.slots = Slots.empty(key_states, value_states)
        self.is_initialized = True

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
        between(self, key_states.shape[2])  # decoding=interval: a compression due before this forward, then its count
        return self.pending

    def _step(self, key_states: torch.Tensor) -> str:
        if self.shared.rehearsing is not None:
            return "rehearse"
        if self.window is not None:
            return "window"
        if key_states.shape[2] > 1 or self.seen == 0:
            return "chunk"
        return "append" if self.unbounded else "claim"

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
        self.steps.saw(self, module, hidden_states, scaling)
        decode = step in ("claim", "append")
        if self.seen == self.shared.columns:  # the first layer this forward reaches
            self.shared.begin(arriving, decode=arriving.shape[1] == 1 and self.seen > 0)
        check_window(self.context.window, self.shared.longest)
        if decode:
            self.prepare_decode()
            result = (
                self._claim(query, key, value, scaling) if step == "claim" else self._append(query, key, value, scaling)
            )
            self.advance()
            return result
        self.seen += arriving.shape[1]
        if step == "window":
            result = self._attend_window(module, query, key, value, attention_mask, scaling, arriving, output)
        else:
            result = self._attend_chunk(
                module, query, key, value, attention_mask, scaling, arriving, output, hidden_states, votes, shared
            )
        self._settled()
        return result

    def _claim(self, query, key, value, scaling) -> torch.Tensor:
        """One token per sequence into the bounded slots, then its attention (see the module)."""
        context, slots, now = self.context, self.slots, self.shared.last
        rule, plan = context.rule, self.plan
        scored = rule.decode_votes != DecodeVote.NONE
        if self.ahead is not None:  # position scores made ahead (prepare_decode)
            start = self.ahead.gather(-1, (now - self.ahead_base).expand(-1, key.shape[1], 1))
        else:
            start = context.policy.key_scores(key, now.expand(-1, key.shape[1], 1), self.layer_idx)
        lowest = claim(
            slots, key, value, now, self.shared.limit(plan["recent"]),
            plan["sinks"].view(-1, 1, 1) if self.sinks else None, 0.0 if start is None else start,
        )  # fmt: skip
        if self.worst is not None:
            torch.maximum(self.worst, lowest, out=self.worst)
        if scored:
            attention = context.implementation.decode_attention
            output = attention(query[:, :, 0], slots.keys, slots.values, slots.held, slots.scores, scaling, rule)
            return output.unsqueeze(2)
        return attend(query, slots, scaling)

    def _append(self, query, key, value, scaling) -> torch.Tensor:
        """One token per sequence into the next slot of growing buffers (each head's own when ragged); its attention."""
        now, context = self.shared.last, self.context
        if self.count is not None:
            append_ragged(self.slots, key, value, now, self.count, arriving_scores(context, key, now, self.layer_idx))
        else:
            append(self.slots, key, value, now, self.fill)
        return self._drop(attend(query, self.slots, scaling))

    def _drop(self, output=None):
        """End a forward (returns ``output``): a rule that drops frees what left the window below its threshold."""
        if self.context.rule.drops:
            drop(self.slots, self.shared.limit(self.plan["recent"]), self.context.rule.threshold)
        return output

    def advance(self) -> None:
        """The host's counts after a decode step (a replayed one too: :mod:`h2o_eval.graphs`)."""
        self.seen += 1
        if self.unbounded:
            if self.count is not None:
                self.room_left -= 1
                self.grown += 1
            else:
                self.filled += 1
            self.most += 1
        else:
            self.most = min(self.most + 1, self.largest)
            self.moved = True
            self.ahead_left -= 1

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps on the device: what a captured decode step may read (h2o_eval.graphs)."""
        kept = [self.fill, self.count, self.ahead, self.ahead_base, self.worst, self.kept, self.rehearsed]
        kept += [] if self.plan is None else list(self.plan.values())
        kept += [] if self.slots is None else list(self.slots.tensors())
        return [tensor for tensor in kept if tensor is not None]

    def buffers(self) -> tuple:
        """What a captured decode step of this layer reads and writes, by address: a step captured for other
        buffers does not fit these."""
        tensors = [*self.slots.tensors(), self.fill, self.count, self.ahead, self.ahead_base, self.worst]
        if self.plan is not None:
            tensors += [self.plan["recent"], self.plan["sinks"]]
        return (self.unbounded, *(None if t is None else (t.data_ptr(), tuple(t.shape)) for t in tensors))

    def capturable(self) -> bool:
        """Whether this layer's next one-token step is a decode step that can be captured (:mod:`h2o_eval.graphs`)."""
        return self.window is None and self.is_initialized and self.seen > 0 and self.pending is None

    def prepare_decode(self) -> bool:
        """Before a decode step, on the host: make the buffers wide enough for one more token (a new bucket for a
        layer that grows). Returns whether the buffers changed (a graph captured for the old ones no longer
        fits)."""
        if self.window is not None:
            return False
        slots = self.slots
        if self.unbounded and self.count is not None:
            if self.room_left > 0:
                return False
            held = self.slots.held.sum(-1).tolist() if self.context.rule.drops else None  # one read per bucket
            counts = held or [[count + self.grown for count in row] for row in self.counts]  # (drops free slots)
            self.most = max(max(row) for row in counts)
            self._ragged(counts, bucket(self.most + 1) - self.most)  # a bucket's room for every head, as dense grow
            return True
        if self.unbounded:
            if self.filled < slots.width:
                return False
            self.slots = widened(slots, bucket(self.filled + 1))
            return True
        if self.ahead is not None and self.ahead_left <= 0:
            self._scores_ahead()
        if self.most < slots.width or slots.width >= self.largest:
            return False
        self.slots = bounded(slots, self.plan["capacity"], min(self.largest, bucket(self.most + 1)))
        return True

    def _scores_ahead(self) -> None:
        """Make (in place, where it exists) the policy's position scores of the next :data:`AHEAD` decode positions of
        each sequence, so that the next claims read them instead of computing them: from the position after the last
        token fed, then from where the previous table ended (decode positions follow one another)."""
        if self.ahead is None:
            self.ahead_base = self.shared.last + 1
        else:
            self.ahead_base.add_(AHEAD)
        kv_heads = self.slots.held.shape[1]
        position = (self.ahead_base + torch.arange(AHEAD, device=self.ahead_base.device)).expand(-1, kv_heads, AHEAD)
        scores = self.context.policy.position_scores(position, self.layer_idx)
        if self.ahead is None:
            self.ahead = scores
        else:
            self.ahead.copy_(scores)
        self.ahead_left = AHEAD

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
        keys, values = torch.cat([slots.keys, key], -2), torch.cat([slots.values, value], -2)
        if first and sequences.deferred or not self.moved and self._evicts_nothing(first, arriving):
            fresh = arriving_scores(context, key, new_position, self.layer_idx)
            self._drop(self._keep_all(keys, values, arriving, new_position, fresh))  # a deferred prompt: after passes
            self.unbounded = not self.moved and bool((self.plan["capacity"] >= UNBOUNDED).all())
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
                capacity=self.plan["capacity"],
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
            capacity=self.plan["capacity"],
            recent=self.plan["recent"],
            sinks=self.plan["sinks"],
            prefill=prefill,
            rule=context.rule,
            scaling=scaling,
            output=output,
            rescore=rescore,
            votes=votes,
        )
        result = context.implementation.chunk(query, keys, values, chunk)
        self.plan["capacity"] = result.capacity
        self.unbounded = bool((result.capacity >= UNBOUNDED).all())
        if result.kept is not None:
            self.kept = result.kept
        entered = torch.cat([slots.held, arriving.unsqueeze(1).expand(batch, kv_heads, n)], dim=-1)
        self._keep(Slots(keys, values, result.held, position, result.scores), entered)
        if result.kept is not None:  # a prompt was compressed: the policy may turn the keys it kept
            self.slots = rerotated(self.slots, self.shared.last, context.rerotation, self.layer_idx)
        return self._drop(result.output)

    def _ragged(self, counts: list[list[int]], room: int) -> None:
        """Lay out a growing layer whose heads hold ``counts`` tokens (per sequence and KV head) ragged, with ``room``
        free slots in every head (:func:`~h2o_eval.decode.ragged`)."""
        self.slots = ragged(self.slots, room, counts)
        self.count = torch.tensor(counts, device=self.slots.held.device)
        self.counts, self.grown, self.room_left, self.fill = counts, 0, room, None

    def _compacted(self) -> Slots:
        """The state a chunk starts from: the slots filled so far (not a growing layer's spare room), in the dense
        layout."""
        slots = self.slots
        if self.count is not None:
            return slots.held_first(self.most)
        if self.unbounded and self.filled < slots.width:
            return slots.map(lambda tensor: tensor[:, :, : self.filled])
        return slots

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
        output = plain_attention(module, query, keys, values, mask, scaling)
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
        return output

    def compress_prompt(self, capacity: torch.Tensor) -> None:
        """Compress a deferred prompt (after its extra passes) to ``capacity`` [B, Hkv] by the scores the passes
        gave it, as a prompt is compressed (:func:`h2o_eval.compression.compress`)."""
        if self.window is not None:
            return
        slots, plan = self.slots, self.plan
        scores = slots.scores if self.rehearsed is None else self.rehearsed
        held, scores, after = compress(
            slots.held, scores, slots.position, capacity, plan["recent"], plan["sinks"],
            self.shared.last.view(-1), self.context.rule,
        )  # fmt: skip
        plan["capacity"], self.kept, self.rehearsed = after, held.sum(-1), None
        self.unbounded = bool((after >= UNBOUNDED).all())
        self._keep(Slots(slots.keys, slots.values, held, slots.position, scores), slots.held)
        self.slots = rerotated(self.slots, self.shared.last, self.context.rerotation, self.layer_idx)
        self._settled()

    def _evicts_nothing(self, first: bool, arriving: torch.Tensor) -> bool:
        """Whether this chunk is plain attention: nothing is ever evicted (an unbounded capacity), or, for a cache
        that sees one chunk only (:func:`h2o_eval.backend.patch`), C covers what could overflow it (the prompt for
        a policy that grows after it, else every token)."""
        capacity = self.plan["capacity"]
        if bool((capacity >= UNBOUNDED).all()):
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

    def _settled(self) -> None:
        """After a chunk or a compression (where reading the device is allowed): the host counts the next decode
        steps go by, the peak so far, and the layout they decode in (:func:`~h2o_eval.decode.bounded`)."""
        slots = self.slots
        held = slots.held.sum(-1)
        self.most = int(held.max()) if held.numel() else 0
        self.peak = max(self.peak, self.most)
        if self.window is not None or self.plan is None or self.shared.deferred:
            return
        plan = self.plan
        self.filled, self.count = slots.width, None
        if self.unbounded:
            if held.numel() and (self.context.rule.drops or bool((held.amax(-1) > held.amin(-1)).any())):
                drops = self.context.rule.drops  # its room now: its regrowths read the device (prepare_decode)
                self._ragged(held.tolist(), bucket(self.most + 1) - self.most if drops else 0)  # heads as they are
                return
            self.fill = torch.tensor([self.filled], dtype=torch.int64, device=slots.held.device)
            return
        capacity = plan["capacity"]
        self.largest = int(capacity.max())
        self.sinks = bool((plan["sinks"] > 0).any())
        protected = (plan["recent"] + plan["sinks"]).view(-1, 1)
        self.worst, self.ahead = None, None
        if self.context.policy.positional:
            self._scores_ahead()
        if bool(((capacity < protected) & (capacity < UNBOUNDED)).any()):  # a full head may have no candidate
            self.worst = torch.full((*capacity.shape, 1), -torch.inf, device=capacity.device)
        self.moved = True
        self.slots = bounded(slots, capacity, min(self.largest, bucket(self.most + 1)))

    def faults(self) -> list[str]:
        """What decode steps noted on the device (reading it waits for the device): a full head whose every held
        token was protected."""
        if self.worst is not None and bool((self.worst == torch.inf).any()):
            return ["eviction needed but every held token is protected: the plan is inconsistent"]
        return []

    # -- copies ----------------------------------------------------------------------------------------------------

    def fork(self, context: LayerContext, shared: Sequences, rows: list[int]) -> EvictionLayer:
        """A copy of this layer's state for sequences ``rows`` (indices), under ``context`` and ``shared``."""
        if self.pending is not None:
            raise RuntimeError("a cache can be forked between forwards only")
        layer = EvictionLayer(context, shared, self.layer_idx, self.window)
        for name in ("seen", "moved", "is_initialized", "unbounded", "peak"):
            setattr(layer, name, getattr(self, name))
        if self.slots is not None:
            layer.slots = self._compacted().rows(rows)
        layer.steps = self.steps.rows_of(rows) if context.interval is not None else layer.steps
        for name in ("kept", "rehearsed"):
            value = getattr(self, name)
            setattr(layer, name, None if value is None else value[torch.tensor(rows, device=value.device)])
        if self.plan is not None:
            index = torch.tensor(rows, device=self.plan["capacity"].device)
            layer.plan = {"capacity": self.plan["capacity"][index]}
            for key in ("recent", "sinks"):
                layer.plan[key] = shared.shared(tuple(self.plan[key][index].tolist()), index.device)
        if layer.is_initialized:
            layer._settled()
        return layer

    def grown_view(self, context: LayerContext, shared: Sequences) -> EvictionLayer:
        """This layer's state, not copied, under ``context`` (:meth:`EvictionCache.grown_view`): tokens fed through
        the view go to buffers of its own (its first append widens a state cut to what is filled), so this layer
        is left as it was."""
        if self.pending is not None:
            raise RuntimeError("a view of a cache is made between forwards only")
        layer = EvictionLayer(context, shared, self.layer_idx, self.window)
        for name in ("seen", "moved", "is_initialized", "kept", "peak", "most"):
            setattr(layer, name, getattr(self, name))
        layer.slots = self._compacted()
        layer.plan = None if self.plan is None else dict(self.plan)  # a chunk through the view sets its own
        layer.unbounded = True
        layer.filled = layer.slots.width
        if self.window is None and self.plan is not None:
            layer.fill = torch.tensor([layer.filled], dtype=torch.int64, device=layer.slots.held.device)
        return layer

    def realised(self, lengths: torch.Tensor) -> torch.Tensor:
        """[B, Hkv] the capacity this layer realised per sequence and KV head, at most the length the budget
        applied to: the tokens kept when the prompt was compressed (or the plan's C); a sliding layer that keeps
        its own window counts as min(length, window)."""
        if self.window is not None:
            return lengths.clamp(max=self.window).float().view(-1, 1).expand(-1, self.slots.held.shape[1])
        planned = self.plan["capacity"].clamp(max=UNBOUNDED - 1)
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
