"""One layer of an :class:`~h2o_eval.cache.EvictionCache`: what it holds, and the named step each chunk takes.

A layer holds keys/values [B, Hkv, S, D] in S slots, and per slot whether it is ``held``, the ``position`` of its
token and its ``score``; a slot that is not held is free, and the next arriving token may take it. Each forward
hands the layer a chunk of new tokens (``update``, then ``attend``), and the chunk takes one of these steps:

- ``chunk``: the mechanism (:func:`h2o_eval.eviction.attend_chunk`) over the held slots and the chunk: a prompt is
  attended in full, scored and compressed; later rows arrive under the policy's decoding rule. A chunk that can
  evict nothing is plain attention, and a deferred prompt (one scored by extra passes) is held whole.
- ``claim``: one decode token per sequence into a bounded cache: it takes a free slot or its victim's, in place;
  the attention and, for a rule that scores while decoding, the scores come from the decode kernel, else from
  torch's fused attention over the held slots.
- ``append``: one decode token per sequence into a cache that can no longer evict: it goes into a new last slot,
  and attends through torch's fused attention.
- ``window``: a sliding layer of a model that also has global layers keeps its last ``window`` - 1 tokens, as
  transformers' own sliding cache does, and the policy does not touch it.
- ``rehearse``: an extra pass over a deferred prompt (KVzip's repeat): it attends, scores the held slots, and its
  own keys and values are dropped again.

A decode step (``claim``, ``append``) never reads a value on the host, so it never waits for the device: what it
must know (how many slots to expose, whether every slot is held) is kept as host counts between chunks, and
what it must refuse (a padding token after the prompt, an inconsistent plan) is noted on the device and raised
when the cache is next read (:meth:`~h2o_eval.cache.EvictionCache.check_faults`).
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from h2o_eval.attention import check_kv_heads, check_window, key_validity, plain_attention
from h2o_eval.eviction import Chunk, attend_held, attend_slots, claim_slot, compress
from h2o_eval.policies import UNBOUNDED, Policy
from h2o_eval.policies.base import DecodeVote
from h2o_eval.policies.inputs import Prompt, Rehearsal

if TYPE_CHECKING:
    from h2o_eval.cache import EvictionCache

STATE = ("keys", "values", "held", "position", "scores")  # what a layer holds per slot
GROWTH = 64  # a layer's buffers grow by 1/64 of its slots (at least MIN_GROWTH) when a decode step needs more: the
# spare room is memory plain generate does not hold, and a copy of the layer every size / 64 steps costs little
MIN_GROWTH = 64


def starting_scores(policy: Policy, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor:
    """Arriving tokens' scores [B, Hkv, n]: the policy's ``key_scores``, or 0."""
    scores = policy.key_scores(key, position, layer)
    return torch.zeros(position.shape, dtype=torch.float32, device=position.device) if scores is None else scores


class EvictionLayer(CacheLayerMixin):
    """One layer's bounded cache (see the module): its slots, the capacity per (sequence, KV head) of its ``plan``,
    and the host counts its decode steps go by. Heads may hold different numbers of tokens (Ada-KV).

    ``is_sliding`` stays False even for a sliding layer: transformers then builds masks over every position seen,
    so the last columns of any layer's mask are the slots it holds."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: EvictionCache, layer_idx: int, window: int | None = None) -> None:
        super().__init__()
        # A weak link: cache -> layers -> cache would be a cycle that only the garbage collector frees, so a
        # loop making one cache per batch would hold every finished cache until a full collection.
        self._owner, self.layer_idx, self.window = weakref.ref(owner), layer_idx, window
        self.seen = 0  # columns fed, padding included
        self.step: str | None = None  # the step of the chunk ``update`` took, until ``attend`` ran it
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys/values ``update`` handed out
        self.plan: dict[str, torch.Tensor] | None = None
        self.moved = False  # whether slots stopped being the model's own positions (an eviction or compaction)
        self.kept: torch.Tensor | None = None  # [B, Hkv] tokens held right after the prompt was compressed
        self.rehearsed: torch.Tensor | None = None  # [B, Hkv, S] the compression scores of a deferred prompt
        self.unbounded = False  # whether no (sequence, KV head) can evict any more: the cache only grows
        self.room: dict[str, torch.Tensor] | None = None  # buffers whose first slots are the state (``_expose``)
        # Host counts a decode step goes by (set after each chunk): an upper bound on the tokens any head holds,
        # the largest and smallest capacity, the longest sequence, and whether every slot is held.
        self.most = 0
        self.capacity_range = (0, 0)
        self.longest = 0
        self.dense = False

    @property
    def owner(self) -> EvictionCache:
        return self._owner()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, _ = key_states.shape
        device = key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.held = torch.zeros(batch, kv_heads, 0, dtype=torch.bool, device=device)
        self.position = torch.zeros(batch, kv_heads, 0, dtype=torch.int64, device=device)
        self.scores = torch.zeros(batch, kv_heads, 0, dtype=torch.float32, device=device)
        self.real_seen = torch.zeros(batch, dtype=torch.int64, device=device)
        self.is_initialized = True

    # -- update: the chunk's keys and values, and its step -------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.check_attended()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        if owner.deferred and self.seen and owner.rehearsing is None:
            raise RuntimeError(
                f"policy {owner.policy.name!r} compresses its prompt after extra passes, which have not run: call "
                "cache.compress(model, tokenizer, input_ids) after the prompt, before feeding more tokens"
            )
        self.step = self._choose(key_states)
        if self.step == "append":
            self.pending = self._append(key_states, value_states)
        elif self.step == "claim":
            self.pending = self._claim(key_states, value_states)
        else:
            self.pending = (torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2))
        return self.pending

    def _choose(self, key_states: torch.Tensor) -> str:
        owner = self.owner
        if owner.rehearsing is not None:
            return "rehearse"
        if self.window is not None:
            return "window"
        if key_states.shape[2] > 1 or self.seen == 0:
            return "chunk"
        return "append" if self.unbounded else "claim"

    def _expose(self, size: int) -> None:
        """Make the state ``size`` slots wide (never narrower), the new slots free: the slots live at the start of
        larger buffers (``room``), grown by 1/64 when they fill, so a decode step copies one token, not the
        whole cache as ``torch.cat`` would."""
        width = self.keys.shape[2]
        if size <= width:
            return
        room = self.room
        if (
            room is None
            or any(room[name].data_ptr() != getattr(self, name).data_ptr() for name in STATE)
            or room["keys"].shape[2] < size
        ):
            room = {}
            for name in STATE:
                tensor = getattr(self, name)
                spare = max(size + width // GROWTH, size + MIN_GROWTH)
                room[name] = tensor.new_zeros(*tensor.shape[:2], spare, *tensor.shape[3:])
                room[name][:, :, :width] = tensor
            self.room = room
        for name in STATE:  # slots never exposed yet are zero: free
            setattr(self, name, room[name][:, :, :size])

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence into a new last slot, in place. Its score is the policy's starting score once
        slots stopped being positions, else 0 (nothing reads it)."""
        width = self.keys.shape[2]
        self._expose(width + 1)
        now = self.real_seen.view(-1, 1).expand(-1, key_states.shape[1])
        self.keys[:, :, width] = key_states[:, :, 0]
        self.values[:, :, width] = value_states[:, :, 0]
        self.held[:, :, width] = True
        self.position[:, :, width] = now
        if self.moved:
            self.scores[:, :, width] = starting_scores(
                self.owner.policy, key_states, now.unsqueeze(-1), self.layer_idx
            )[:, :, 0]
        self.most += 1
        return self.keys, self.values

    def _claim(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence into a bounded cache, in place: each (sequence, KV head) evicts its victim when it
        holds C, else takes a free slot, of which there is one: the state is first made as wide as the most tokens
        any head can hold after this one."""
        most, largest = self.most, self.capacity_range[1]
        self._expose(min(most + 1, largest))
        plan, now = self.plan, self.real_seen
        slot, fault = claim_slot(
            self.held, self.position, self.scores, now, plan["capacity"], plan["recent"], plan["sinks"]
        )
        self.owner.note_fault("plan", fault)
        self.most = min(most + 1, largest)
        self.dense = self.dense and self.capacity_range[0] == largest
        self.moved = True
        at = slot.unsqueeze(-1)
        new_position = now.view(-1, 1, 1).expand(-1, key_states.shape[1], 1)
        self.held.scatter_(-1, at, True)
        self.position.scatter_(-1, at, new_position)
        self.scores.scatter_(-1, at, starting_scores(self.owner.policy, key_states, new_position, self.layer_idx))
        index = at.unsqueeze(-1).expand(-1, -1, 1, key_states.shape[-1])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        return self.keys, self.values

    def check_attended(self) -> None:
        """Refuse to go on when the keys this layer handed out never reached the backend's attention."""
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
        """This layer's attention for the chunk ``update`` just took, and the cache state after it. Without
        ``output`` (a :class:`~h2o_eval.groups.SharedPrompt` pass, which computes the prompt's attention once)
        only the state is computed, and None returned. ``hidden_states``: the attention module's input (a scorer
        may read it). ``votes``: the prompt votes the other caches of that pass computed
        (:attr:`~h2o_eval.eviction.Chunk.votes`); ``shared``: what their scorers computed of the prompt
        (:meth:`~h2o_eval.policies.inputs.Prompt.once`)."""
        self.pending = None
        step, self.step = self.step, None
        owner = self.owner
        check_kv_heads(module, query, key, owner.kv_heads)
        arriving = key_validity(attention_mask, key.shape[0], query.shape[2], key.device)
        if step == "rehearse":
            return self._rehearse(module, query, key, value, attention_mask, scaling, arriving, hidden_states)
        if step in ("claim", "append"):
            self.longest += 1
            if owner.window is not None:
                check_window(owner.window, self.longest)
            owner.note_fault("padding", ~arriving.all())
            result = self._attend_decode(module, query, key, value, attention_mask, scaling, step)
            self.seen += 1
            self.real_seen = self.real_seen + arriving.sum(-1)
            return result
        self.longest = int((self.real_seen + arriving.sum(-1)).max())
        if owner.window is not None:
            check_window(owner.window, self.longest)
        if step == "window":
            result = self._attend_window(module, query, key, value, attention_mask, scaling, arriving, output)
        else:
            result = self._attend_chunk(
                module, query, key, value, attention_mask, scaling, arriving, output, hidden_states, votes, shared
            )
        self._settled()
        return result

    def _attend_decode(self, module, query, key, value, attention_mask, scaling, step: str) -> torch.Tensor:
        """A decode token's attention over the held slots: the decode kernel where the rule's scores change, else
        torch's fused attention (the model's own mask while slots are still positions)."""
        owner = self.owner
        if step == "claim" and owner.rule.decode_votes != DecodeVote.NONE:
            return attend_held(query, key, value, self.held, self.scores, owner.rule, scaling, owner.triton)
        if not self.moved:
            return plain_attention(module, query, key, value, attention_mask, scaling)
        return attend_slots(query, key, value, None if self.dense else self.held, scaling)

    def _attend_chunk(
        self, module, query, key, value, attention_mask, scaling, arriving, output, hidden_states, votes, shared
    ):
        """A chunk through the mechanism: the first one fixes the layer's plan and may be a prompt."""
        owner = self.owner
        owner.check_faults()
        batch, kv_heads, n = key.shape[0], key.shape[1], query.shape[2]
        first = self.seen == 0
        if first:
            self.plan = owner.layer_plan(self.layer_idx, arriving, kv_heads)
            if (own := owner.policy.attention(query, key, value, arriving, scaling)) is not None:
                self._keep_all(key, value, arriving)
                return own
        new_position = (self.real_seen.unsqueeze(-1) + arriving.cumsum(-1) - 1).clamp(min=0)
        new_position = new_position.unsqueeze(1).expand(batch, kv_heads, n)
        if first and owner.deferred or not self.moved and self._evicts_nothing(first, arriving):
            self._keep_all(key, value, arriving, new_position)  # a deferred prompt is compressed after its passes
            self.unbounded = not self.moved and bool((self.plan["capacity"] >= UNBOUNDED).all())
            return plain_attention(module, query, key, value, attention_mask, scaling) if output else None
        position = torch.cat([self.position, new_position], dim=-1).contiguous()
        fresh = starting_scores(owner.policy, key[:, :, -n:], new_position, self.layer_idx)
        prefill = owner.prompt_rows(arriving) if first else torch.zeros(batch, dtype=torch.int64, device=key.device)
        rescore = None
        if first and owner.policy.rescores:
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
                rotary=owner.rotary_of(self.layer_idx),
                scaling=scaling,
                shared=shared,
            )

            def rescore(scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
                found = owner.policy.compression_scores(prompt, scores, protected)
                return scores if found is None else found.float()

        chunk = Chunk(
            held=torch.cat([self.held, torch.zeros(batch, kv_heads, n, dtype=torch.bool, device=key.device)], -1),
            arriving=arriving,
            position=position,
            scores=torch.cat([self.scores, fresh], dim=-1),
            capacity=self.plan["capacity"],
            recent=self.plan["recent"],
            sinks=self.plan["sinks"],
            prefill=prefill,
            rule=owner.rule,
            scaling=scaling,
            output=output,
            rescore=rescore,
            votes=votes,
        )
        result = owner.kernel(query, key, value, chunk)
        self.plan["capacity"] = result.capacity
        self.unbounded = bool((result.capacity >= UNBOUNDED).all())
        if result.kept is not None:
            self.kept = result.kept
        entered = torch.cat([self.held, arriving.unsqueeze(1).expand(batch, kv_heads, n)], dim=-1)
        self._keep(key, value, result.held, position, result.scores, entered)
        self._advance(arriving)
        return result.output

    def _keep(self, key, value, held, position, scores, entered) -> None:
        """The state after a chunk: its slots as they are if nothing left, else only the held slots (per head,
        padded to the fullest head)."""
        if torch.equal(held, entered):
            self.keys, self.values = key, value
        else:
            self.moved = True
            size = int(held.sum(-1).max())
            order = torch.argsort((~held).to(torch.int8), dim=-1, stable=True)[..., :size]
            self.keys = key.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1]))
            self.values = value.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, value.shape[-1]))
            held, position, scores = held.gather(-1, order), position.gather(-1, order), scores.gather(-1, order)
        self.held, self.position, self.scores = held, position, scores

    def _rehearse(self, module, query, key, value, attention_mask, scaling, arriving, hidden_states) -> torch.Tensor:
        """An extra pass (:meth:`EvictionCache.rehearsal`): its tokens attend to the held slots and to each other,
        the policy scores the slots by what the pass shows it, and the pass's keys and values are dropped (the
        state stays the prompt's). A sliding layer only attends."""
        mask = None if attention_mask is None else attention_mask[..., -key.shape[2] :]
        output = plain_attention(module, query, key, value, mask, scaling)
        if self.window is None:
            owner = self.owner
            rehearsal = Rehearsal(
                index=owner.rehearsing,
                script=owner.script,
                module=module,
                layer=self.layer_idx,
                query=query,
                key=key,
                value=value,
                held=self.held,
                position=self.position,
                real=arriving,
                scaling=scaling,
                hidden_states=hidden_states,
            )
            before = torch.zeros_like(self.scores) if self.rehearsed is None else self.rehearsed
            self.rehearsed = owner.policy.rehearse(rehearsal, before).float()
        return output

    def compress_prompt(self, capacity: torch.Tensor) -> None:
        """Compress a deferred prompt (after its extra passes) to ``capacity`` [B, Hkv] by the scores the passes
        gave it, as a prompt is compressed (:func:`h2o_eval.eviction.compress`)."""
        if self.window is not None:
            return
        owner = self.owner
        scores = self.scores if self.rehearsed is None else self.rehearsed
        held, scores, after = compress(
            self.held, scores, self.position, capacity, self.plan["recent"], self.plan["sinks"], self.real_seen - 1,
            owner.rule,
        )  # fmt: skip
        self.plan["capacity"], self.kept, self.rehearsed = after, held.sum(-1), None
        self.unbounded = bool((after >= UNBOUNDED).all())
        self._keep(self.keys, self.values, held, self.position, scores, self.held)
        self._settled()

    def _evicts_nothing(self, first: bool, arriving: torch.Tensor) -> bool:
        """Whether this chunk is plain attention: nothing is ever evicted (an unbounded capacity), or, for a cache
        that sees one chunk only (:func:`h2o_eval.backend.patch`), C covers what could overflow it (the prompt for
        a policy that grows after it, else every token)."""
        capacity = self.plan["capacity"]
        if bool((capacity >= UNBOUNDED).all()):
            return True
        owner = self.owner
        if not (first and owner.one_forward):
            return False
        limit = torch.tensor(owner.lengths, device=capacity.device) if owner.rule.grows else arriving.sum(-1)
        return bool((capacity >= limit.view(-1, 1)).all())

    def _keep_all(self, key, value, arriving, new_position=None) -> None:
        """Hold every arriving token (a chunk that evicts nothing); their scores stay 0, as nothing reads them."""
        batch, kv_heads, n = key.shape[0], key.shape[1], arriving.shape[1]
        self.keys, self.values = key, value
        self.held = torch.cat([self.held, arriving.unsqueeze(1).expand(batch, kv_heads, n)], dim=-1)
        if new_position is not None:
            self.position = torch.cat([self.position, new_position], dim=-1)
        self.scores = torch.cat([self.scores, self.scores.new_zeros(batch, kv_heads, n)], dim=-1)
        self._advance(arriving)

    def _attend_window(self, module, query, key, value, attention_mask, scaling, arriving, output=True):
        """The model's own sliding-window attention over the slots held (the mask's last columns), then keep the
        last ``window`` - 1 slots."""
        if self.seen > 0:
            self.owner.note_fault("padding", ~arriving.all())
        mask = None if attention_mask is None else attention_mask[..., -key.shape[2] :]
        result = plain_attention(module, query, key, value, mask, scaling) if output else None
        keep = min(key.shape[2], self.window - 1)
        self.keys, self.values = key[:, :, key.shape[2] - keep :], value[:, :, value.shape[2] - keep :]
        self.held = torch.ones(key.shape[0], key.shape[1], keep, dtype=torch.bool, device=key.device)
        self._advance(arriving)
        return result

    def _advance(self, arriving: torch.Tensor) -> None:
        self.seen += arriving.shape[1]
        self.real_seen = self.real_seen + arriving.sum(-1)

    def _settled(self) -> None:
        """After a chunk or a compression (where reading the device is allowed): the host counts the next decode
        steps go by, and the peak so far."""
        held = self.held.sum(-1)
        self.most = int(held.max()) if held.numel() else 0
        self.dense = bool(self.held.all())
        if self.plan is not None:
            capacity = self.plan["capacity"]
            self.capacity_range = (int(capacity.min()), int(capacity.max()))
        owner = self.owner
        owner.peak_entries = max(owner.peak_entries, self.most)

    # -- copies ----------------------------------------------------------------------------------------------------

    def fork(self, owner: EvictionCache, rows: list[int]) -> EvictionLayer:
        """A copy of this layer's state for sequences ``rows`` (indices), belonging to ``owner``."""
        if self.pending is not None:
            raise RuntimeError("a cache can be forked between forwards only")
        layer = EvictionLayer(owner, self.layer_idx, self.window)
        for name in ("seen", "moved", "is_initialized", "unbounded", "most", "capacity_range", "longest", "dense"):
            setattr(layer, name, getattr(self, name))
        for name in ("keys", "values", "held", "position", "scores", "real_seen", "kept", "rehearsed"):
            value = getattr(self, name, None)
            setattr(layer, name, None if value is None else value[torch.tensor(rows, device=value.device)])
        if self.plan is not None:
            layer.plan = {key: value[torch.tensor(rows, device=value.device)] for key, value in self.plan.items()}
        if layer.is_initialized:
            layer._settled()
        return layer

    def grown_view(self, owner: EvictionCache) -> EvictionLayer:
        """This layer's state, not copied, for ``owner`` (:meth:`EvictionCache.grown_view`): tokens fed through
        the view go to buffers of its own, so this layer is left as it was."""
        if self.pending is not None:
            raise RuntimeError("a view of a cache is made between forwards only")
        layer = copy.copy(self)
        layer._owner, layer.room = weakref.ref(owner), None
        layer.plan = None if self.plan is None else dict(self.plan)  # a chunk through the view sets its own
        layer.unbounded = True
        return layer

    def realised(self, lengths: torch.Tensor) -> torch.Tensor:
        """[B, Hkv] the capacity this layer realised per sequence and KV head, at most the length the budget
        applied to: the tokens kept when the prompt was compressed (or the plan's C); a sliding layer that keeps
        its own window counts as min(length, window)."""
        if self.window is not None:
            return lengths.clamp(max=self.window).float().view(-1, 1).expand(-1, self.held.shape[1])
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
        self.is_initialized = False
        self.seen, self.step, self.pending, self.plan, self.moved, self.kept = 0, None, None, None, False, None
        self.unbounded, self.room, self.most, self.longest, self.dense = False, None, 0, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictionCache does not support beam search")
