"""The eviction state: :class:`EvictionCache`, a transformers ``Cache`` that physically holds at most C entries per
(sequence, layer, KV head), and what is read off it (:class:`CapacityLog`).

Every protocol runs through it. Its first chunk may begin with a **prompt** (the ``prefill`` and ``context``
protocols: those rows attend in full, vote, and are compressed to C); every later row, in the first chunk or in
any later one, arrives under the policy's decoding rule (:mod:`h2o_eval.eviction`). ``generate()`` and
step-by-step forwards keep one cache across calls; :func:`h2o_eval.backend.patch` gives each whole-sequence forward
a fresh one. Each layer's attention call reaches its :class:`EvictionLayer` through the hook of
:mod:`h2o_eval.attention` (the cache hands the layer over as the attention function's ``eviction`` argument).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_eval.attention import (
    check_kv_heads,
    check_supported,
    check_window,
    install,
    key_validity,
    kv_head_count,
    layer_windows,
    plain_attention,
    rotary_function,
)
from h2o_eval.errors import ConfigError
from h2o_eval.eviction import (
    Chunk,
    attend_chunk,
    attend_chunk_reference,
    attend_chunk_triton,
    attend_held,
    claim_slot,
    compress,
)
from h2o_eval.policies import UNBOUNDED, Full, Policy, check_decoding, check_kernels, check_protocol
from h2o_eval.policies.base import DecodeVote
from h2o_eval.policies.inputs import Prompt, Rehearsal, Script

# auto: Triton on CUDA tensors, the numba-compiled scan elsewhere; torch: the plain reference loop; triton: forced.
KERNEL_FUNCTIONS = {"auto": attend_chunk, "torch": attend_chunk_reference, "triton": attend_chunk_triton}


def kernel_function(kernels: str, device: torch.device):
    """The implementation of the mechanism ``kernels`` names, for tensors on ``device``."""
    if kernels == "auto" and device.type == "cuda":
        return attend_chunk_triton
    return KERNEL_FUNCTIONS[kernels]


def _decode_triton(kernels: str, model: torch.nn.Module) -> bool:
    """Whether decode steps run the Triton kernel: ``auto`` on CUDA, ``triton`` where Triton can run."""
    device = next(model.parameters()).device
    check_kernels(kernels, device.type)
    return kernels == "triton" or (kernels == "auto" and device.type == "cuda")


def plan_tensors(
    policy: Policy, lengths: list[int], layer: int, num_layers: int, kv_heads: int, device
) -> dict[str, torch.Tensor]:
    """One layer's plan for sequences whose budgets apply to ``lengths``: capacity [B, Hkv], recent and sinks [B]."""
    plans = [policy.plan(max(length, 1), layer, num_layers) for length in lengths]
    capacity = torch.tensor([p.capacity for p in plans], dtype=torch.int64, device=device)
    return {
        "capacity": capacity.view(-1, 1).expand(-1, kv_heads).contiguous(),
        "recent": torch.tensor([p.recent for p in plans], dtype=torch.int64, device=device),
        "sinks": torch.tensor([p.sinks for p in plans], dtype=torch.int64, device=device),
    }


def starting_scores(policy: Policy, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor:
    """Arriving tokens' scores [B, Hkv, n]: the policy's ``key_scores``, or 0."""
    scores = policy.key_scores(key, position, layer)
    return torch.zeros(position.shape, dtype=torch.float32, device=position.device) if scores is None else scores


class EvictionLayer(CacheLayerMixin):
    """One layer's bounded cache: keys/values [B, Hkv, S, D] with each slot's held flag, position and score, and
    the layer's capacity per (sequence, KV head). Heads may hold different numbers of tokens (Ada-KV); a slot
    that is not held is free and the next arriving token takes it. A sliding layer of a model that also has
    global layers (``window``) holds its last ``window`` - 1 tokens between forwards, as transformers' own
    sliding cache does, and the policy does not touch it (see ``h2o_eval.attention.layer_windows``).

    ``is_sliding`` stays False even there: transformers then builds masks over every position seen, so the last
    columns of any layer's mask are the slots it holds."""

    is_sliding = False
    is_croppable = False

    @property
    def owner(self) -> EvictionCache:
        return self._owner()

    def __init__(self, owner: EvictionCache, layer_idx: int, window: int | None = None) -> None:
        super().__init__()
        # A weak link: cache -> layers -> cache would be a cycle that only the garbage collector frees, so a
        # loop making one cache per batch would hold every finished cache until a full collection.
        self._owner, self.layer_idx, self.window = weakref.ref(owner), layer_idx, window
        self.seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.slot: torch.Tensor | None = None  # [B, Hkv] slot the single arriving token took (decode steps)
        self.plan: dict[str, torch.Tensor] | None = None
        self.moved = False  # whether slots stopped being the model's own positions (an eviction or compaction)
        self.kept: torch.Tensor | None = None  # [B, Hkv] tokens held right after the prompt was compressed
        self.rehearsed: torch.Tensor | None = None  # [B, Hkv, S] the compression scores of a deferred prompt
        self.unbounded = False  # whether no (sequence, KV head) can evict any more: the cache only grows
        self.appended = False  # whether ``update`` appended a decode step's token (see ``_append``)
        self.room: dict[str, torch.Tensor] | None = None  # buffers whose first slots are keys, values, ...

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, _ = key_states.shape
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.held = torch.zeros(batch, kv_heads, 0, dtype=torch.bool, device=key_states.device)
        self.position = torch.zeros(batch, kv_heads, 0, dtype=torch.int64, device=key_states.device)
        self.scores = torch.zeros(batch, kv_heads, 0, dtype=torch.float32, device=key_states.device)
        self.real_seen = torch.zeros(batch, dtype=torch.int64, device=key_states.device)
        self.is_initialized = True

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
        step = self.window is None and key_states.shape[2] == 1 and self.seen > 0 and owner.rehearsing is None
        if step and self.unbounded and owner.rule.decode_votes == DecodeVote.NONE:
            # A cache that can no longer evict and whose scores no longer change: the token goes at the end.
            self.appended = True
            self.pending = self._append(key_states, value_states)
            return self.pending
        if step and not self.unbounded and (slot := self._claim(key_states)) is not None:
            # One token per sequence into a warm cache: evict (or take a free slot) right here, in place.
            index = slot.view(*slot.shape, 1, 1).expand(-1, -1, 1, key_states.shape[-1])
            self.keys.scatter_(2, index, key_states)
            self.values.scatter_(2, index, value_states)
            self.slot, self.pending = slot, (self.keys, self.values)
            return self.keys, self.values
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.pending = (keys, values)
        return keys, values

    def check_attended(self) -> None:
        """Refuse to go on when the keys this layer handed out never reached the backend's attention."""
        if self.pending is not None:
            raise RuntimeError(
                f"layers [{self.layer_idx}] did not run through the h2o_eval attention backend: this model cannot "
                "be evaluated with eviction (refusing to report unpatched numbers)"
            )

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put one token per sequence in a new last slot, in place: the slots live at the start of larger buffers
        (``room``), grown by an eighth when they fill, so a step copies one token, not the whole cache as
        ``torch.cat`` would. Its score is the policy's starting score once slots stopped being positions, else 0
        (as :meth:`_keep_all` gives; nothing reads it)."""
        size = self.keys.shape[2]
        state = {
            "keys": self.keys, "values": self.values, "held": self.held, "position": self.position,
            "scores": self.scores,
        }  # fmt: skip
        room = self.room
        if (
            room is None
            or any(room[name].data_ptr() != tensor.data_ptr() for name, tensor in state.items())
            or room["keys"].shape[2] == size
        ):
            room = {}
            for name, tensor in state.items():
                room[name] = tensor.new_empty(*tensor.shape[:2], size + max(size // 8, 64), *tensor.shape[3:])
                room[name][:, :, :size] = tensor
            self.room = room
        now = self.real_seen.view(-1, 1).expand(-1, key_states.shape[1])
        room["keys"][:, :, size] = key_states[:, :, 0]
        room["values"][:, :, size] = value_states[:, :, 0]
        room["held"][:, :, size] = True
        room["position"][:, :, size] = now
        if self.moved:
            fresh = starting_scores(self.owner.policy, key_states, now.unsqueeze(-1), self.layer_idx)
            room["scores"][:, :, size] = fresh[:, :, 0]
        else:
            room["scores"][:, :, size] = 0
        for name in state:
            setattr(self, name, room[name][:, :, : size + 1])
        return self.keys, self.values

    def _claim(self, key_states: torch.Tensor) -> torch.Tensor | None:
        plan = self.plan
        now = self.real_seen
        slot = claim_slot(self.held, self.position, self.scores, now, plan["capacity"], plan["recent"], plan["sinks"])
        if slot is None:
            return None
        self.moved = True
        at = slot.unsqueeze(-1)
        new_position = now.view(-1, 1, 1).expand(-1, key_states.shape[1], 1)
        self.held.scatter_(-1, at, True)
        self.position.scatter_(-1, at, new_position)
        fresh = starting_scores(self.owner.policy, key_states, new_position, self.layer_idx)
        self.scores.scatter_(-1, at, fresh)
        return slot

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
        ``output`` (a :class:`SharedPrompt` pass, which computes the prompt's attention once) only the state is
        computed, and None returned. ``hidden_states``: the attention module's input (a scorer may read it).
        ``votes``: the prompt votes the other caches of that pass computed (:attr:`~h2o_eval.eviction.Chunk.votes`);
        ``shared``: what their scorers computed of the prompt (:meth:`~h2o_eval.policies.inputs.Prompt.once`)."""
        self.pending = None
        owner = self.owner
        batch, kv_heads, n = key.shape[0], key.shape[1], query.shape[2]
        check_kv_heads(module, query, key, owner.kv_heads)
        arriving = key_validity(attention_mask, batch, n, key.device)
        if owner.rehearsing is not None:
            return self._rehearse(module, query, key, value, attention_mask, scaling, arriving, hidden_states)
        if owner.window is not None:
            check_window(owner.window, int((self.real_seen + arriving.sum(-1)).max()))
        if self.window is not None:
            return self._attend_window(module, query, key, value, attention_mask, scaling, arriving, output)
        if self.appended:
            if not bool(arriving.all()):
                raise RuntimeError(
                    "a padding token after the prompt: EvictionCache takes padding only in the first chunk"
                )
            self.appended = False
            if self.moved:  # slots are no longer positions: the model's mask does not apply to them
                output = attend_held(query, key, value, self.held, self.scores, owner.rule, scaling, owner.triton)
            else:
                output = plain_attention(module, query, key, value, attention_mask, scaling)
            self._advance(arriving)
            return output
        if self.slot is not None:
            if not bool(arriving.all()):
                raise RuntimeError(
                    "a padding token after the prompt: EvictionCache takes padding only in the first chunk"
                )
            self.slot = None
            rule = owner.rule
            output = attend_held(query, key, value, self.held, self.scores, rule, scaling, owner.triton)
            self._advance(arriving)
            return output
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
        if self.seen > 0 and not bool(arriving.all()):
            raise RuntimeError("a padding token after the prompt: EvictionCache takes padding only in the first chunk")
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
        self.owner.peak_entries = max(self.owner.peak_entries, int(self.held.sum(-1).max()))

    def fork(self, owner: EvictionCache, rows: list[int]) -> EvictionLayer:
        """A copy of this layer's state for sequences ``rows`` (indices), belonging to ``owner``."""
        if self.pending is not None or self.slot is not None:
            raise RuntimeError("a cache can be forked between forwards only")
        layer = EvictionLayer(owner, self.layer_idx, self.window)
        layer.seen, layer.moved, layer.is_initialized = self.seen, self.moved, self.is_initialized
        layer.unbounded = self.unbounded
        for name in ("keys", "values", "held", "position", "scores", "real_seen", "kept", "rehearsed"):
            value = getattr(self, name, None)
            setattr(layer, name, None if value is None else value[torch.tensor(rows, device=value.device)])
        if self.plan is not None:
            layer.plan = {key: value[torch.tensor(rows, device=value.device)] for key, value in self.plan.items()}
        return layer

    def grown_view(self, owner: EvictionCache) -> EvictionLayer:
        """This layer's state, not copied, for ``owner`` (:meth:`EvictionCache.grown_view`): tokens fed through
        the view go to buffers of its own, so this layer is left as it was."""
        if self.pending is not None or self.slot is not None:
            raise RuntimeError("a view of a cache is made between forwards only")
        layer = copy.copy(self)
        layer._owner, layer.room = weakref.ref(owner), None
        layer.plan = None if self.plan is None else dict(self.plan)  # a chunk through the view sets its own
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
        self.seen, self.pending, self.slot, self.plan, self.moved, self.kept = 0, None, None, None, False, None
        self.unbounded, self.appended, self.room = False, False, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictionCache does not support beam search")


class EvictionCache(Cache):
    """A transformers ``Cache`` that holds at most C entries per (sequence, layer, KV head).

    ``protocol="simulate"``: the first chunk is fed under per-step eviction from an empty cache;
    ``protocol="prefill"`` or ``"context"``: the first ``prompt`` real tokens of each sequence's first chunk (all
    of them by default: the prompt, or the context before the question) attend in full and are then compressed to
    the budget. Every later token arrives under the policy's decoding rule: one eviction per arriving token once
    the cache is full, or none for policies that grow after their prompt. A fraction budget applies to ``length``
    (int or one per sequence) or, if None, to the first chunk's real length. ``one_forward``: the cache serves one
    whole-sequence forward and nothing after it (``patch``), so a chunk that can evict nothing is plain attention
    and a policy that computes its own attention (the authors' H2O simulation) may run. ``decoding="grow"``:
    nothing is evicted after the prompt's compression, whatever the policy's own rule (kvpress's pipeline, whose
    presses act once). Creating the cache routes the model's attention through the h2o_eval backend; forwards
    without an EvictionCache keep plain SDPA.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        *,
        protocol: str = "simulate",
        length: int | list[int] | None = None,
        prompt: list[int] | None = None,
        kernels: str = "auto",
        one_forward: bool = False,
        decoding: str = "evict",
    ) -> None:
        check_supported(model)
        check_protocol(policy, protocol, kernels)
        check_decoding(protocol, decoding)
        if not policy.has_cache and not (one_forward and protocol == "simulate"):
            raise ConfigError(
                f"policy {policy.name!r} exists only as a simulation of scoring, with no cache: use patch(..., "
                "'simulate')"
            )
        if one_forward and policy.rehearses:
            raise ConfigError(
                f"policy {policy.name!r} scores its prompt by extra passes before compressing it, which one "
                "whole-sequence forward cannot run: use it on a generation task"
            )
        self.policy, self.protocol, self.length, self.prompt = policy, protocol, length, prompt
        self.decoding = decoding
        # The rule the mechanism reads: the policy's, or with decoding=grow one that keeps every later token.
        self.rule = dataclasses.replace(policy.rule, grows=True) if decoding == "grow" else policy.rule
        self.one_forward = one_forward
        self.kernel = kernel_function(kernels, next(model.parameters()).device)
        self.triton = _decode_triton(kernels, model)
        self.peak_entries = 0
        windows, self.window = layer_windows(model)
        self.num_layers = len(windows)
        self.kv_heads = kv_head_count(model)
        self.lengths: list[int] | None = None
        self.rotary = rotary_function(model)
        # A policy that scores its prompt by extra passes holds it whole until they ran (compress_prompt).
        self.deferred = policy.rehearses and protocol != "simulate"
        self.rehearsing: int | None = None  # the extra pass being fed, if any
        self.script: Script | None = None  # what the extra passes were built from
        super().__init__(layers=[EvictionLayer(self, i, window) for i, window in enumerate(windows)])
        install(model)

    def rotary_of(self, layer: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """``rotary(positions)`` -> (cos, sin) of ``layer``'s rotary embedding, or None (see :class:`Prompt`)."""
        if self.rotary is None:
            return None
        return functools.partial(self.rotary, layer)

    def compress(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        questions: list[list[int]] | None = None,
        **generate_kwargs: Any,
    ) -> None:
        """Compress the prompt this cache was fed (``input_ids``, left-padded as ``attention_mask`` says) by a
        policy's extra passes: KVzip's repeat of the context, the oracle's question and full-cache answer. They run
        through ``model`` now, their own keys and values are dropped, and each KV head keeps its C. Any other
        policy compressed its prompt as it came: nothing happens. ``questions``: per sequence the question's
        token ids (the oracle's passes need them; under ``protocol="context"`` they come after the compressed
        context); ``generate_kwargs``: how the full-cache answer is generated (greedy by default)."""
        from h2o_eval.generation import settle

        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        asked = [[] for _ in range(input_ids.shape[0])] if questions is None else questions
        settle(model, self, tokenizer, input_ids, mask, asked, **({"do_sample": False} | generate_kwargs))

    @contextlib.contextmanager
    def rehearsal(self, index: int, script: Script) -> Iterator[None]:
        """Within the block, forwards through this cache are extra pass ``index`` (built from ``script``) of a
        deferred prompt: they score its slots (the policy's :meth:`~h2o_eval.policies.Policy.rehearse`) and leave
        the state as it was."""
        if not self.deferred or any(layer.kept is not None for layer in self.layers):
            raise RuntimeError("extra passes run between a deferred prompt and its compression only")
        self.rehearsing, self.script = index, script
        try:
            yield
        finally:
            self.rehearsing = None

    def adopt_rehearsal(self, other: EvictionCache) -> None:
        """Take the scores ``other``'s extra passes gave its prompt instead of running them: both hold one deferred
        prompt, the same slots, under policies of one :meth:`~h2o_eval.policies.Policy.rehearsal_identity`
        (budgets apart), so the passes would score this prompt exactly alike."""
        if not (self.deferred and other.deferred):
            raise RuntimeError("extra-pass scores pass between deferred prompts before their compression only")
        if self.policy.rehearsal_identity() != other.policy.rehearsal_identity():
            raise ValueError(
                f"{self.policy.describe()} and {other.policy.describe()} score their prompts differently: only "
                "caches whose policies differ in budget share their extra passes"
            )
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if mine.window is not None:
                continue
            if not (torch.equal(mine.held, theirs.held) and torch.equal(mine.position, theirs.position)):
                raise ValueError("the caches hold different prompts: extra passes are shared by one prompt's caches")
            mine.rehearsed = None if theirs.rehearsed is None else theirs.rehearsed.clone()

    def compress_prompt(self) -> None:
        """Compress a deferred prompt after its extra passes: each layer to its planned C, or to the capacities
        the policy allocates across layers from all their scores (:meth:`~h2o_eval.policies.Policy.allocate`)."""
        layers = [layer for layer in self.layers if layer.window is None]
        planned = [layer.plan["capacity"] for layer in layers]
        scores = [layer.scores if layer.rehearsed is None else layer.rehearsed for layer in layers]
        held = [layer.held for layer in layers]
        capacities = self.policy.allocate(scores, held, planned) or planned
        for layer, capacity in zip(layers, capacities, strict=True):
            layer.compress_prompt(capacity)
        self.deferred = False

    def fork(self, rows: list[int]) -> EvictionCache:
        """A copy of this cache's state for the sequences ``rows``, which then evolves alone: several questions
        are answered from one compressed context, each from its own copy, none seeing another's tokens. It costs
        a copy of what the cache holds (at most C entries per layer and KV head) for the rows."""
        clone = copy.copy(self)
        clone.lengths = None if self.lengths is None else [self.lengths[r] for r in rows]
        clone.length = clone.lengths
        clone.prompt = None if self.prompt is None else [self.prompt[r] for r in rows]
        clone.layers = [layer.fork(clone, rows) for layer in self.layers]
        return clone

    def full_copy(self) -> EvictionCache:
        """A copy of this cache as the full cache would be after the same forwards: made between a deferred
        prompt and its compression, while every token fed is held in its own position, it holds them all under
        :class:`~h2o_eval.policies.Full` (nothing ever evicted), exactly as a full cache fed alongside holds them.
        What it then generates is that full cache's answer, without feeding the prompt again."""
        if not self.deferred or self.rehearsing is not None or any(layer.moved for layer in self.layers):
            raise RuntimeError("a full copy is made of a deferred prompt before its extra passes and compression only")
        policy = Full()
        clone = copy.copy(self)
        clone.policy, clone.deferred, clone.script = policy, False, None
        clone.rule = dataclasses.replace(policy.rule, grows=True) if self.decoding == "grow" else policy.rule
        clone.layers = [layer.fork(clone, list(range(len(self.lengths)))) for layer in self.layers]
        for layer in clone.layers:
            if layer.plan is not None:
                kv_heads, device = layer.held.shape[1], layer.held.device
                layer.plan = plan_tensors(policy, self.lengths, layer.layer_idx, self.num_layers, kv_heads, device)
                layer.unbounded = True
        return clone

    def grown_view(self) -> EvictionCache:
        """This compressed cache under ``decoding=grow``, not copied, as a cache that appends every token it is
        fed and attends to what it holds: what the cache itself would attend to, with no score kept up to date
        (under ``grow`` nothing reads them again). The cache is left as it was."""
        if self.decoding != "grow" or self.deferred or self.protocol == "simulate":
            raise ValueError("only compressed caches under decoding=grow (which evict nothing more) are stacked")
        view = copy.copy(self)
        view.policy, view.script, view.peak_entries = Full(), None, 0
        view.rule = dataclasses.replace(view.policy.rule, grows=True)
        view.layers = [layer.grown_view(view) for layer in self.layers]
        return view

    @classmethod
    def stack(cls, caches: list[EvictionCache]) -> EvictionCache:
        """One cache whose sequences are those of ``caches`` in order, for feeding them the same tokens in one
        batch: compressed caches of one model under ``decoding=grow``, which evict nothing any more whatever
        their policies. Each layer hands each cache's rows to that cache's layer (a :meth:`grown_view`), which
        attends to what it holds as it would alone, over its own slots only; what is batched is the rest of the
        model. The inputs are left as they were."""
        if len({tuple(layer.seen for layer in c.layers) for c in caches}) != 1:
            raise ValueError("the caches have seen different tokens: only caches fed the same tokens are stacked")
        views = [cache.grown_view() for cache in caches]
        stacked = copy.copy(views[0])
        stacked.views = views  # the layers' owners (held weakly by their layers)
        stacked.lengths = [length for view in views for length in view.lengths]
        stacked.length = stacked.lengths
        stacked.prompt = None if views[0].prompt is None else [p for view in views for p in view.prompt]
        rows = [len(view.lengths) for view in views]
        stacked.layers = [StackedLayer([view.layers[i] for view in views], rows) for i in range(len(views[0].layers))]
        return stacked

    def grown_peak(self, fed: int) -> int:
        """The peak entries of this compressed cache under ``decoding=grow`` once ``fed`` more tokens per sequence
        were fed: every one takes a new slot in each layer that is not sliding (a sliding layer never holds more
        than it held already)."""
        most = max(int(layer.held.sum(-1).max()) for layer in self.layers if layer.window is None)
        return max(self.peak_entries, most + fed)

    def eviction_layer(self, layer: int) -> EvictionLayer:
        """The layer an attention call of ``layer`` attends through (see :mod:`h2o_eval.attention`)."""
        return self.layers[layer]

    def check_attended(self) -> None:
        """After a forward: every layer that took keys attended through the backend."""
        for layer in self.layers:
            layer.check_attended()

    def layer_plan(self, layer: int, arriving: torch.Tensor, kv_heads: int) -> dict[str, torch.Tensor]:
        """The layer's capacity per (sequence, KV head), recent window and sinks, fixed on the first chunk."""
        if self.lengths is None:
            batch = arriving.shape[0]
            if self.length is not None:
                self.lengths = [self.length] * batch if isinstance(self.length, int) else list(self.length)
            elif (
                arriving.shape[1] == 1
                and not self.one_forward
                and self.policy.capacity(1) != self.policy.capacity(1 << 20)
            ):
                raise ConfigError(
                    "a fraction budget needs a length: give EvictionCache(..., length=N) or a token budget"
                )
            else:
                self.lengths = arriving.sum(-1).tolist()
        return plan_tensors(self.policy, self.lengths, layer, self.num_layers, kv_heads, arriving.device)

    def prompt_rows(self, arriving: torch.Tensor) -> torch.Tensor:
        """[B] the first chunk's rows that are prompt rows (left padding included): none under ``simulate``, the
        first ``prompt`` real tokens when given, else the whole chunk."""
        batch, n = arriving.shape
        if self.protocol == "simulate":
            return torch.zeros(batch, dtype=torch.int64, device=arriving.device)
        if self.prompt is None:
            return torch.full((batch,), n, dtype=torch.int64, device=arriving.device)
        pads_before = (arriving.cumsum(-1) == 0).sum(-1)
        return pads_before + torch.tensor(self.prompt, device=arriving.device)

    def realised(self) -> list[torch.Tensor]:
        """Per layer, [B, Hkv] the capacity realised per sequence and KV head (see :meth:`EvictionLayer.realised`)."""
        return [
            layer.realised(torch.tensor(self.lengths, device=layer.held.device))
            for layer in self.layers
            if layer.window is not None or layer.plan is not None
        ]

    def capacity(self) -> torch.Tensor:
        """[B] realised C per sequence: mean over layers and KV heads."""
        return torch.stack([kept.mean(-1) for kept in self.realised()]).mean(0)

    def kv_bytes(self) -> int:
        """Bytes of keys and values the cache holds now."""
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.is_initialized)

    def entry_bytes(self) -> int:
        """Bytes of one token's key and value in one KV head."""
        keys = next(layer.keys for layer in self.layers if layer.is_initialized)
        return 2 * keys.shape[-1] * keys.element_size()


class CapacityLog:
    """The realised capacities of every sequence scored in a run, read off its caches the same way whatever the
    runner: per sequence the length its budget applied to and, per layer, the tokens each KV head kept."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.layers: list[list[float]] = []  # per sequence: each layer's C, mean over KV heads
        self.spreads: list[int] = []  # per (sequence, layer): most minus fewest tokens kept by a KV head
        self.entries: list[float] = []  # per sequence: KV entries kept, summed over layers and KV heads
        self.entry_bytes = 0

    def add(self, cache: EvictionCache) -> list[float]:
        """Log every sequence of a cache that has seen its prompt; returns each one's C (mean over layers and KV
        heads)."""
        per_layer = cache.realised()
        layer_means = torch.stack([kept.mean(-1) for kept in per_layer], dim=1)  # [B, layers]
        self.lengths.extend(cache.lengths)
        self.layers.extend(layer_means.tolist())
        self.spreads.extend(int(s) for kept in per_layer for s in (kept.amax(-1) - kept.amin(-1)).tolist())
        self.entries.extend(torch.stack([kept.sum(-1) for kept in per_layer]).sum(0).tolist())
        self.entry_bytes = cache.entry_bytes()
        return layer_means.mean(-1).tolist()

    def stats(self) -> dict[str, Any]:
        """The record's ``capacity``: C (mean over layers and KV heads) per sequence, its mean/min/max, the length
        it applied to, the kept share, each layer's mean C, how unevenly KV heads were filled, and the bytes of
        keys and values kept per sequence."""
        kept = [sum(layers) / len(layers) for layers in self.layers]
        count = max(len(kept), 1)
        by_layer = list(zip(*self.layers, strict=True)) if self.layers else []
        return {
            "sequences": len(kept),
            "length_mean": sum(self.lengths) / count,
            "capacity_mean": sum(kept) / count,
            "capacity_min": min(kept, default=0),
            "capacity_max": max(kept, default=0),
            "kept_fraction_mean": sum(c / max(n, 1) for n, c in zip(self.lengths, kept, strict=True)) / count,
            "layer_capacity_mean": [sum(values) / len(values) for values in by_layer],
            "head_spread_mean": sum(self.spreads) / max(len(self.spreads), 1),
            "kv_bytes_mean": sum(self.entries) / count * self.entry_bytes,
        }


class LayersOfCaches(CacheLayerMixin):
    """One layer of several :class:`EvictionCache` s fed as one: ``layers``, one per cache, all having seen the
    same tokens."""

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


class StackedLayer(LayersOfCaches):
    """One layer of a stacked cache (:meth:`EvictionCache.stack`): each cache's rows of a chunk go to that
    cache's layer, which takes them and attends as it would alone; the outputs are the rows in order."""

    def __init__(self, layers: list[EvictionLayer], rows: list[int]) -> None:
        super().__init__(layers)
        self.is_initialized = True
        ends = list(itertools.accumulate(rows))
        self.rows = [slice(end - count, end) for end, count in zip(ends, rows, strict=True)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for layer, rows in zip(self.layers, self.rows, strict=True):
            layer.update(key_states[rows], value_states[rows])
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scaling, hidden_states=None) -> torch.Tensor:
        outputs = []
        for layer, rows in zip(self.layers, self.rows, strict=True):
            keys, values = layer.pending
            mask = None if attention_mask is None else attention_mask[rows]
            own = None if hidden_states is None else hidden_states[rows]
            outputs.append(layer.attend(module, query[rows], keys, values, mask, scaling, hidden_states=own))
        return torch.cat(outputs)


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
    """Feeds one first chunk (a prompt, or a context) to several empty :class:`EvictionCache` s of one model at
    once. In the ``prefill`` and ``context`` protocols that chunk attends in full whatever the policy, so its
    attention is computed once (as the full cache computes it), while each cache scores and compresses it by its
    own policy; the caches then go on alone. Decoding through a ``SharedPrompt`` is refused: the policies part
    there."""

    def __init__(self, caches: list[EvictionCache]) -> None:
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
