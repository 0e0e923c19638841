"""The eviction state: :class:`EvictionCache`, a transformers ``Cache`` that physically holds at most C entries per
(sequence, layer, KV head), one :class:`~h2o_eval.layer.EvictionLayer` per layer.

Every protocol runs through it. Its first chunk may begin with a **prompt** (the ``prefill`` and ``context``
protocols: those rows attend in full, vote, and are compressed to C); every later row, in the first chunk or in
any later one, arrives under the policy's decoding rule (:mod:`h2o_eval.eviction`). ``generate()`` and
step-by-step forwards keep one cache across calls; :func:`h2o_eval.backend.patch` gives each whole-sequence forward
a fresh one. Each layer's attention call reaches its layer through the hook of :mod:`h2o_eval.attention` (the
cache hands the layer over as the attention function's ``eviction`` argument).

The cache holds what is the same for every layer: the policy, the protocol and the rule it decodes under, the
lengths budgets apply to, a prompt deferred until its extra passes ran, and the copies made of it (a fork per
question, the full cache's copy, the view a stacked decode reads).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache

from h2o_eval.attention import check_supported, install, kv_head_count, layer_windows, rotary_function
from h2o_eval.errors import ConfigError
from h2o_eval.eviction import attend_chunk, attend_chunk_reference, attend_chunk_triton
from h2o_eval.groups import StackedLayer
from h2o_eval.layer import EvictionLayer
from h2o_eval.policies import Full, Policy, check_decoding, check_kernels, check_protocol
from h2o_eval.policies.inputs import Script

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
        self._peak_entries = 0
        self.faults: dict[str, torch.Tensor] = {}  # what decode steps noted on the device (check_faults)
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

    @property
    def peak_entries(self) -> int:
        """The most KV entries a (sequence, KV head) of any layer has held. Between chunks held counts only grow
        (a decode token takes a free slot or its victim's), so the peak is the larger of the last chunk's and what
        is held now; reading it waits for the device, so it is read after decoding."""
        held = [layer.held for layer in self.layers if layer.is_initialized and layer.held.numel()]
        return max(self._peak_entries, *(int(h.sum(-1).max()) for h in held))

    @peak_entries.setter
    def peak_entries(self, value: int) -> None:
        self._peak_entries = value

    def note_fault(self, kind: str, fault: torch.Tensor) -> None:
        """Keep a [] bool a decode step found on the device (``padding``: a padding token after the prompt; ``plan``:
        a full cache whose every held token is protected), to be raised by :meth:`check_faults`."""
        self.faults[kind] = fault if kind not in self.faults else self.faults[kind] | fault

    def check_faults(self) -> None:
        """Raise what decode steps noted (:meth:`note_fault`): called where the cache is read or fed a chunk, so
        no decode step waits for the device."""
        faults, self.faults = self.faults, {}
        if "padding" in faults and bool(faults["padding"]):
            raise RuntimeError("a padding token after the prompt: EvictionCache takes padding only in the first chunk")
        if "plan" in faults and bool(faults["plan"]):
            raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")

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
        self.check_faults()
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
        self.check_faults()
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
        """Per layer, [B, Hkv] the capacity realised per sequence and KV head
        (:meth:`~h2o_eval.layer.EvictionLayer.realised`)."""
        self.check_faults()
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
