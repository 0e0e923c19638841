"""The eviction state: :class:`EvictionCache`, a transformers ``Cache`` that physically holds at most C entries per
(sequence, layer, KV head), one :class:`~h2o_eval.layer.EvictionLayer` per layer.

Every protocol runs through it. Its first chunk may begin with a **prompt** (the ``prefill`` and ``context``
protocols: those rows attend in full, vote, and are compressed to C); every later row, in the first chunk or in
any later one, arrives under the policy's decoding rule (:mod:`h2o_eval.eviction`). ``generate()`` and
step-by-step forwards keep one cache across calls; :func:`h2o_eval.backend.patch` gives each whole-sequence forward
a fresh one. Each layer's attention call reaches its layer through the hook of :mod:`h2o_eval.attention` (the
cache hands the layer over as the attention function's ``eviction`` argument).

The cache fixes what is the same for every layer once (:class:`~h2o_eval.layer.LayerContext`: the policy, the rule
it decodes under, the implementation chosen from ``kernels``), holds what its layers share about the sequences
(:class:`~h2o_eval.layer.Sequences`), and makes the copies a run needs: a fork per question, the full cache's
copy, the view a stacked decode reads. A policy's extra passes before its prompt's compression are run by
:func:`h2o_eval.generation.compress`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache

from h2o_eval.attention import (
    check_supported,
    check_window,
    host_bound_rotary,
    install,
    kv_head_count,
    layer_windows,
    rotary_function,
)
from h2o_eval.context import LayerContext, Sequences
from h2o_eval.errors import ConfigError
from h2o_eval.graphs import CudaGraph, DecodeGraphs, RecordedGraph, host_state, restore_host_state
from h2o_eval.graphs import install as install_graphs
from h2o_eval.implementation import choose
from h2o_eval.interval import Intervals, Turn
from h2o_eval.kernels.reference import CONSTANTS
from h2o_eval.layer import EvictionLayer
from h2o_eval.policies import Full, Interval, Policy, Rule, check_decoding, check_protocol
from h2o_eval.policies.base import refuse_interval_policy
from h2o_eval.policies.inputs import Script
from h2o_eval.rerotation import inverse_frequencies


def decoding_rule(policy: Policy, decoding: str) -> Rule:
    """The rule a cache decodes under: the policy's, or with ``decoding="grow"`` or ``"interval"`` one that keeps
    every later token (an interval's compressions come between forwards, :mod:`h2o_eval.interval`)."""
    return dataclasses.replace(policy.rule, grows=True, drops=False) if decoding != "evict" else policy.rule


def resolve_interval(policy: Policy, decoding: str, interval: Interval | None) -> Interval | None:
    """``decoding=interval``'s settings (kvpress's defaults when None), their decoding policy the cache's own when
    unset; None under another decoding, which takes no such settings."""
    if decoding != "interval":
        if interval is not None:
            raise ConfigError(f"interval settings apply to decoding=interval, not decoding={decoding}: drop them")
        return None
    interval = interval or Interval()
    if interval.policy is None:
        refuse_interval_policy(policy)
        interval = dataclasses.replace(interval, policy=policy)
    return interval


@dataclasses.dataclass(frozen=True)
class Statistics:
    """What a run's logs read of a cache that has answered (:meth:`~h2o_eval.generation.log.GenerationLog.add`,
    :meth:`~h2o_eval.capacity.CapacityLog.add`), taken from it by :meth:`EvictionCache.statistics` so that the cache
    can be let go before it answers: a stacked cell's compressed cache is freed while the stack's view of it decodes,
    and the view's growth is counted by :meth:`grown`. ``held_most``: the most entries a (sequence, KV head) of a
    layer that is not sliding held."""

    lengths: list[int]
    capacities: list[torch.Tensor]
    allocated_bytes: int
    one_entry_bytes: int
    num_layers: int
    kv_heads: int
    peak_entries: int
    graphs: DecodeGraphs | None
    held_most: int
    evicted: tuple[list[float], list[int | None]]

    def realised(self) -> list[torch.Tensor]:
        return self.capacities

    def evictions(self) -> tuple[list[float], list[int | None]]:
        return self.evicted

    def kv_bytes(self) -> int:
        return self.allocated_bytes

    def entry_bytes(self) -> int:
        return self.one_entry_bytes

    def grown(self, fed: int) -> Statistics:
        """These statistics once ``fed`` more tokens per sequence were fed under ``decoding=grow``: every one takes a
        new slot in each layer that is not sliding (a sliding layer never holds more than it held already)."""
        return dataclasses.replace(self, peak_entries=max(self.peak_entries, self.held_most + fed))


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
    presses act once); ``decoding="interval"``: none either, but every ``interval.compression_interval`` forwards
    the cache is compressed to ``interval``'s target by its decoding policy's scores
    (:class:`~h2o_eval.policies.Interval`, :mod:`h2o_eval.interval`: kvpress's DecodingPress). ``graphs``: on a
    CUDA device, decode steps are captured as CUDA graphs and replayed (:mod:`h2o_eval.graphs`, which names what is
    not captured); False decodes eagerly. Creating the cache routes the model's attention through the h2o_eval
    backend; forwards without an EvictionCache keep plain SDPA.
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
        graphs: bool | str = True,
        interval: Interval | None = None,
    ) -> None:
        check_supported(model)
        check_protocol(policy, protocol, kernels)
        check_decoding(protocol, decoding, policy)
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
        if policy.rerotates and (one_forward or prompt is not None):
            raise ConfigError(
                f"policy {policy.name!r} re-rotates the keys its prompt kept, so the prompt is fed alone and the rest "
                "after it: use it on a generation task (EvictionCache without prompt=), or without re-rotation "
                "(finch: rerotate_keys=False; key_rerotation: its base alone)"
            )
        windows, window = layer_windows(model)
        device = next(model.parameters()).device
        self.decoding = decoding
        self.context = LayerContext(
            policy=policy,
            rule=decoding_rule(policy, decoding),
            implementation=choose(kernels, device),
            protocol=protocol,
            num_layers=len(windows),
            kv_heads=kv_head_count(model),
            window=window,
            length=tuple(length) if isinstance(length, list) else length,
            prompt=None if prompt is None else tuple(prompt),
            one_forward=one_forward,
            rotary=rotary_function(model),
            rerotation=tuple(inverse_frequencies(model, f"policy {policy.name!r}")) if policy.rerotates else None,
            interval=resolve_interval(policy, decoding, interval),
        )
        # A policy that scores its prompt by extra passes holds it whole until they ran (compress_prompt).
        self.shared = Sequences(deferred=policy.rehearses and protocol != "simulate")
        self._peak_entries = 0
        super().__init__(layers=[EvictionLayer(self.context, self.shared, i, w) for i, w in enumerate(windows)])
        install(model)
        # Decode steps captured as CUDA graphs (or their emulation) and replayed (h2o_eval.graphs), where they apply.
        self.graphs: DecodeGraphs | None = None
        graph = {True: CudaGraph if device.type == "cuda" else None, False: None, "emulate": RecordedGraph}
        if graphs not in graph:
            raise ConfigError(f"graphs={graphs!r}: use true, false or emulate")
        if graphs == "emulate" and (kernels == "triton" or kernels == "auto" and device.type == "cuda"):
            raise ConfigError(
                "graphs=emulate replays aten operations, which Triton's kernels are not: use kernels=torch (or "
                "kernels=auto on a CPU)"
            )
        if graph[graphs] is not None and not one_forward and host_bound_rotary(model) is None:
            self.graphs = DecodeGraphs(graph[graphs])
            install_graphs(model)

    # -- what the layers share, as the runners read it ------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self.context.policy

    @property
    def rule(self) -> Rule:
        return self.context.rule

    @property
    def protocol(self) -> str:
        return self.context.protocol

    @property
    def num_layers(self) -> int:
        return self.context.num_layers

    @property
    def kv_heads(self) -> int:
        return self.context.kv_heads

    @property
    def lengths(self) -> list[int] | None:
        """Per sequence, the length its budget applied to (known once the first chunk was fed)."""
        return self.shared.lengths

    @property
    def deferred(self) -> bool:
        """Whether the prompt is held whole until the policy's extra passes ran (:meth:`compress_prompt`)."""
        return self.shared.deferred

    @property
    def peak_entries(self) -> int:
        """The most KV entries a (sequence, KV head) of any layer has held. Between chunks held counts only grow
        (a decode token takes a free slot or its victim's), so the peak is the larger of the last chunk's and what
        is held now; reading it waits for the device, so it is read after decoding."""
        held = [layer.held for layer in self.layers if layer.is_initialized and layer.held.numel()]
        peaks = [layer.peak for layer in self.layers]
        return max(self._peak_entries, *peaks, *(int(h.sum(-1).max()) for h in held))

    @peak_entries.setter
    def peak_entries(self, value: int) -> None:
        self._peak_entries = value

    def evicted_tokens(self) -> torch.Tensor:
        """[B] float32: per sequence, the tokens its cache has let go: those it has seen less those it holds, per KV
        head, the mean over the layers that do not slide (a sliding window drops tokens as the model does). On the
        device; nothing is read."""
        seen = self.shared.last.view(-1, 1).to(torch.float32) + 1
        gone = [seen - layer.held.sum(-1) for layer in self.layers if layer.window is None and layer.is_initialized]
        return torch.stack(gone).mean(dim=(0, 2))

    def note_evictions(self) -> None:
        """After a watched forward (:func:`~h2o_eval.generation.passes.decode` with ``watch``): each sequence that
        holds fewer tokens than it has seen, and held them all after every earlier watched forward, is noted with this
        forward's number (the generated token it gave; ``Sequences.evicted_from``). On the device; nothing is read."""
        shared = self.shared
        gone = self.evicted_tokens() > 0
        if shared.evicted_from is None:
            shared.evicted_from = torch.full_like(gone, -1, dtype=torch.int64)
        first = (shared.evicted_from < 0) & gone
        shared.evicted_from.masked_fill_(first, shared.forwards)
        shared.forwards += 1

    def check_faults(self) -> None:
        """Raise what decode steps noted on the device (a padding token after the prompt; a full cache whose every
        held token was protected): called where the cache is read or fed a chunk, so no decode step waits for the
        device."""
        real = self.shared.real
        if real is not None and not bool(real.all()):
            real.fill_(True)
            raise RuntimeError("a padding token after the prompt: EvictionCache takes padding only in the first chunk")
        for layer in self.layers:
            for fault in layer.faults():
                raise RuntimeError(fault)

    # -- a deferred prompt: its extra passes, then its compression -----------------------------------------------

    @contextlib.contextmanager
    def rehearsal(self, index: int, script: Script) -> Iterator[None]:
        """Within the block, forwards through this cache are extra pass ``index`` (built from ``script``) of a
        deferred prompt: they score its slots (the policy's :meth:`~h2o_eval.policies.Policy.rehearse`) and leave
        the state as it was."""
        if not self.deferred or any(layer.kept is not None for layer in self.layers):
            raise RuntimeError("extra passes run between a deferred prompt and its compression only")
        self.shared.rehearsing, self.shared.script = index, script
        try:
            yield
        finally:
            self.shared.rehearsing = None

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
            mine.adopt_rehearsal(theirs)

    def compress_prompt(self) -> None:
        """Compress a deferred prompt after its extra passes: each layer to its planned C, or to the capacities
        the policy allocates across layers from all their scores (:meth:`~h2o_eval.policies.Policy.allocate`)."""
        layers = [layer for layer in self.layers if layer.window is None]
        planned = [layer.plan.capacity for layer in layers]
        scores = [layer.scores if layer.rehearsed is None else layer.rehearsed for layer in layers]
        held = [layer.held for layer in layers]
        capacities = self.policy.allocate(scores, held, planned) or planned
        self.shared.deferred = False
        for layer, capacity in zip(layers, capacities, strict=True):
            layer.compress_prompt(capacity)

    # -- turns of a conversation (protocol=turns) -----------------------------------------------------------------

    def begin_turn(self) -> None:
        """From now on every layer keeps the attention inputs fed (eagerly: no CUDA graph records them), which
        :meth:`compress_turn` scores by. A policy whose scores need a pass of its own over a prompt (kvzip, the
        oracle, snapkv's question-aware window) cannot be compressed so and is refused."""
        refuse_interval_policy(self.policy, "protocol=turns", "a turn's", "; or compress the context only")
        interval = Interval(policy=self.policy)
        self.turn_start = self.shared.last + 1  # [B] the position the turn's first token takes
        for layer in self.layers:
            layer.turn = Turn(interval)

    def compress_turn(self, schedule: str) -> None:
        """Compress what every layer holds at the end of a turn (:meth:`EvictionLayer.compress_turn`), by the
        attention inputs kept since :meth:`begin_turn`: ``nested`` over everything held, ``new_turn`` over the
        tokens fed since, the older ones untouched."""
        since = None if schedule == "nested" else self.turn_start
        for layer in self.layers:
            layer.compress_turn(since)

    # -- copies --------------------------------------------------------------------------------------------------

    def _copy(self, context: LayerContext, shared: Sequences) -> EvictionCache:
        clone = copy.copy(self)
        clone.context, clone.shared, clone._peak_entries = context, shared, 0
        clone.graphs = None if self.graphs is None else self.graphs.fresh()  # a copy replays captures of its own
        return clone

    def fork(self, rows: list[int]) -> EvictionCache:
        """A copy of this cache's state for the sequences ``rows``, which then evolves alone: several questions
        are answered from one compressed context, each from its own copy, none seeing another's tokens. It costs
        a copy of what the cache holds (at most C entries per layer and KV head) for the rows."""
        self.check_faults()
        lengths = None if self.lengths is None else tuple(self.lengths[r] for r in rows)
        context = dataclasses.replace(self.context.rows(rows), length=lengths)
        clone = self._copy(context, self.shared.rows(rows))
        clone._peak_entries = self._peak_entries
        clone.layers = [layer.fork(context, clone.shared, rows) for layer in self.layers]
        return clone

    def rows(self, keep: list[int]) -> EvictionCache:
        """The sequences ``keep`` alone, to go on with those (the others' answers ended:
        :func:`~h2o_eval.generation.passes.decode_leaving`): a :meth:`fork` of them."""
        return self.fork(keep)

    def full_copy(self) -> EvictionCache:
        """A copy of this cache as the full cache would be after the same forwards: made between a deferred
        prompt and its compression, while every token fed is held in its own position, it holds them all under
        :class:`~h2o_eval.policies.Full` (nothing ever evicted), exactly as a full cache fed alongside holds them.
        What it then generates is that full cache's answer, without feeding the prompt again."""
        if not self.deferred or self.shared.rehearsing is not None or any(layer.moved for layer in self.layers):
            raise RuntimeError("a full copy is made of a deferred prompt before its extra passes and compression only")
        policy = Full()
        rows = list(range(len(self.lengths)))
        context = dataclasses.replace(
            self.context, policy=policy, rule=decoding_rule(policy, self.decoding), interval=None
        )
        clone = self._copy(context, self.shared.rows(rows))
        clone.shared.deferred = False
        clone.layers = [layer.fork(context, clone.shared, rows, full=True) for layer in self.layers]
        return clone

    def grown_view(self) -> EvictionCache:
        """This compressed cache under ``decoding=grow``, not copied, as a cache that appends every token it is
        fed and attends to what it holds: what the cache itself would attend to, with no score kept up to date
        (under ``grow`` nothing reads them again). The cache is left as it was."""
        if self.decoding != "grow" or self.deferred or self.protocol == "simulate":
            raise ValueError("only compressed caches under decoding=grow (which evict nothing more) are stacked")
        self.check_faults()
        policy = Full()
        context = dataclasses.replace(self.context, policy=policy, rule=decoding_rule(policy, "grow"))
        view = self._copy(context, self.shared.rows(list(range(len(self.lengths)))))
        view.layers = [layer.grown_view(context, view.shared) for layer in self.layers]
        return view

    @classmethod
    def stack(cls, caches: list[EvictionCache]) -> Cache:
        """One cache whose sequences are those of ``caches`` in order, for feeding them the same tokens in one
        batch (:class:`~h2o_eval.groups.StackedCache`)."""
        from h2o_eval.groups import StackedCache

        return StackedCache([cache.grown_view() for cache in caches])

    def statistics(self) -> Statistics:
        """What a run's logs read of this cache, taken now (:class:`Statistics`)."""
        return Statistics(
            lengths=list(self.lengths),
            capacities=self.realised(),
            allocated_bytes=self.kv_bytes(),
            one_entry_bytes=self.entry_bytes(),
            num_layers=self.num_layers,
            kv_heads=self.kv_heads,
            peak_entries=self.peak_entries,
            graphs=self.graphs,
            held_most=max(int(layer.held.sum(-1).max()) for layer in self.layers if layer.window is None),
            evicted=self.evictions(),
        )

    def evictions(self) -> tuple[list[float], list[int | None]]:
        """Per sequence, the tokens its cache has let go (:meth:`evicted_tokens`, read now) and the generated token
        from which it had (:meth:`note_evictions`; None where no forward was watched or none had let a token go)."""
        gone = [round(float(tokens), 2) for tokens in self.evicted_tokens().tolist()]
        first = self.shared.evicted_from
        since = [None] * len(gone) if first is None else [None if f < 0 else f for f in first.tolist()]
        return gone, since

    # -- decode steps as CUDA graphs (h2o_eval.graphs) -------------------------------------------------------------

    def capturable(self, batch: int) -> bool:
        """Whether the next one-token forward of ``batch`` sequences is a decode step that can be captured: every
        layer decodes into static buffers (none keeps a sliding window), no prompt waits for extra passes, and no
        layer keeps its step's attention input (a voting policy under ``decoding=interval``)."""
        return (
            not self.deferred
            and self.shared.rehearsing is None
            and self.lengths is not None
            and len(self.lengths) == batch
            and all(layer.capturable() and not (layer.steps and layer.steps.keeps) for layer in self.layers)
        )

    def prepare_decode(self) -> None:
        """Before a decode step, on the host: what the step would refuse eagerly (a model whose every layer slides,
        outgrown), every layer compressed if ``decoding=interval`` says so, and its buffers wide enough for one more
        token."""
        check_window(self.context.window, self.shared.longest + 1)
        for layer in self.layers:
            layer.prepare_decode()

    def buffers(self) -> tuple:
        """What a captured decode step reads and writes, by address (:meth:`~h2o_eval.layer.EvictionLayer.buffers`)."""
        shared = self.shared
        own = tuple(None if t is None else t.data_ptr() for t in (shared.last, shared.real))
        return own + tuple(layer.buffers() for layer in self.layers)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache keeps that a decode step may read or write: what a captured step may read without
        owning it (:class:`~h2o_eval.graphs.RecordedGraph`)."""
        layers = (tensor for layer in self.layers for tensor in layer.tensors())
        return [*self.shared.tensors(), *layers, *CONSTANTS.values()]

    def host_state(self) -> list[tuple[object, dict]]:
        """The host's state of the cache (its sequences' and layers' counts), to restore after a capture that raised
        (:meth:`restore_host_state`)."""
        parts = [self.shared, *self.layers, *(layer.steps for layer in self.layers if layer.steps is not None)]
        layouts = [layer.layout for layer in self.layers if layer.layout is not None]
        return host_state([*parts, *layouts, *(layout.inner for layout in layouts if isinstance(layout, Intervals))])

    restore_host_state = staticmethod(restore_host_state)

    def advance(self) -> None:
        """The host's counts after a replayed decode step, as the step's own code moves them."""
        self.shared.advance()
        for layer in self.layers:
            layer.advance()

    # -- what transformers and the backend ask ------------------------------------------------------------------

    def eviction_layer(self, layer: int) -> EvictionLayer:
        """The layer an attention call of ``layer`` attends through (see :mod:`h2o_eval.attention`)."""
        return self.layers[layer]

    def check_attended(self) -> None:
        """After a forward: every layer that took keys attended through the backend."""
        for layer in self.layers:
            layer.check_attended()

    # -- what the cache holds ---------------------------------------------------------------------------------------

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
        """Bytes of the keys and values the cache has allocated now (a growing layer's spare slots included)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def entry_bytes(self) -> int:
        """Bytes of one token's key and value in one KV head."""
        keys = next(layer.keys for layer in self.layers if layer.is_initialized)
        return 2 * keys.shape[-1] * keys.element_size()
