"""What the layers of one :class:`~h2o_eval.cache.EvictionCache` share: the frozen :class:`LayerContext` the cache
fixes once (policy, rule, implementation, window, protocol), the :class:`Sequences` its first layer advances every
forward (lengths and positions), and the plan a layer's budget gives it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.implementation import Implementation
from h2o_eval.policies import UNBOUNDED, Interval, Policy, Rule
from h2o_eval.policies.inputs import Script


@dataclass(frozen=True)
class LayerContext:
    """What every layer of one cache reads and nothing changes: the policy and the rule it decodes under (with
    ``decoding=grow``, one that keeps every token after the prompt), the implementation of the mechanism, the
    protocol, and the model's shape.

    ``length``: what a fraction budget applies to (an int, one per sequence, or None: the first chunk's real
    length); ``prompt``: per sequence, the real tokens of its first chunk that are its prompt (None: the whole
    chunk); ``one_forward``: the cache serves one whole-sequence forward (``patch``); ``window``: the sliding window
    that bounds every layer of a model whose layers all slide (None otherwise); ``rotary(layer, positions)``: the
    model's rotary embedding (None without); ``rerotation``: per layer the rotary's inverse frequencies by which a
    compressed prompt's kept keys are re-rotated (:mod:`h2o_eval.rerotation`), None for a policy that keeps them;
    ``interval``: ``decoding=interval``'s settings, its decoding policy resolved (None under another decoding)."""

    policy: Policy
    rule: Rule
    implementation: Implementation
    protocol: str
    num_layers: int
    kv_heads: int
    window: int | None = None
    length: int | tuple[int, ...] | None = None
    prompt: tuple[int, ...] | None = None
    one_forward: bool = False
    rotary: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    rerotation: tuple[torch.Tensor, ...] | None = None
    interval: Interval | None = None

    def prompt_rows(self, arriving: torch.Tensor) -> torch.Tensor:
        """[B] the first chunk's rows that are prompt rows (left padding included; ``arriving`` [B, n] marks the
        real tokens): none under ``simulate``, the first ``prompt`` real tokens when given, else the whole chunk."""
        batch, n = arriving.shape
        if self.protocol == "simulate":
            return torch.zeros(batch, dtype=torch.int64, device=arriving.device)
        if self.prompt is None:
            return torch.full((batch,), n, dtype=torch.int64, device=arriving.device)
        pads_before = (arriving.cumsum(-1) == 0).sum(-1)
        return pads_before + torch.tensor(self.prompt, device=arriving.device)

    def rows(self, rows: list[int]) -> LayerContext:
        """This context for the sequences ``rows`` of its batch."""
        length = self.length if self.length is None or isinstance(self.length, int) else self.length
        if isinstance(length, tuple):
            length = tuple(length[r] for r in rows)
        prompt = None if self.prompt is None else tuple(self.prompt[r] for r in rows)
        return dataclasses.replace(self, length=length, prompt=prompt)


class Sequences:
    """What the layers of one cache share about its sequences: the lengths budgets apply to (fixed on the first
    chunk), the columns fed, the longest real length, and ``last`` [B, 1, 1], the position of each sequence's last
    real token (on the device). The first layer a forward reaches advances them (:meth:`begin`); the other layers
    read them. Also whether the prompt waits for its extra passes (``deferred``) and the extra pass being fed."""

    def __init__(self, deferred: bool = False) -> None:
        self.lengths: list[int] | None = None
        self.columns = 0
        self.longest = 0
        self.last: torch.Tensor | None = None
        self.starts: torch.Tensor | None = None  # [B, 1, 1] the last position before the current chunk
        self.deferred = deferred
        self.rehearsing: int | None = None
        self.script: Script | None = None
        self.real: torch.Tensor | None = None  # [B] bool: every token after the first chunk was real (no padding)
        # Where generate's forwards are watched (EvictionCache.note_evictions): the forwards so far, and per sequence
        # [B] the first after which it held fewer tokens than it had seen (-1: none yet).
        self.forwards = 0
        self.evicted_from: torch.Tensor | None = None
        self._limits: dict[int, torch.Tensor] = {}
        self._plans: dict[tuple, torch.Tensor] = {}

    def begin(self, arriving: torch.Tensor, decode: bool) -> None:
        """A forward's first layer: ``arriving`` [B, n] of its tokens are real. A decode token moves each position
        one on without reading anything on the host; a chunk also counts its longest sequence."""
        if self.last is None:
            self.last = torch.full((arriving.shape[0], 1, 1), -1, dtype=torch.int64, device=arriving.device)
        if decode:
            self.last.add_(1)
            self.real.logical_and_(arriving[:, -1])
            self.advance()
            return
        if self.real is None:
            self.real = torch.ones(arriving.shape[0], dtype=torch.bool, device=arriving.device)
        self._limits = {}
        self.columns += arriving.shape[1]
        self.starts = self.last
        self.last = self.last + arriving.sum(-1).view(-1, 1, 1)
        self.longest = int(self.last.max()) + 1

    def note_padding(self, arriving: torch.Tensor) -> None:
        """Note a padding token after the prompt, as a decode step would (a sliding layer's later chunks)."""
        self.real.logical_and_(arriving.all(-1))

    def advance(self) -> None:
        """The host's counts after a decode step (a replayed one too: :mod:`h2o_eval.graphs`)."""
        self._limits = {}
        self.columns += 1
        self.longest += 1

    def tensors(self) -> list[torch.Tensor]:
        """The tensors these counts keep on the device (what a captured decode step reads: :mod:`h2o_eval.graphs`)."""
        kept = [self.last, self.starts, self.real, *self._plans.values()]
        return [tensor for tensor in kept if tensor is not None]

    def positions(self, arriving: torch.Tensor) -> torch.Tensor:
        """[B, n] each arriving column's position in its sequence (a padding column takes its neighbour's)."""
        return (self.starts.view(-1, 1) + arriving.cumsum(-1)).clamp(min=0)

    def limit(self, recent: torch.Tensor) -> torch.Tensor:
        """[B, 1, 1] the newest position a decode token may evict under the window ``recent`` [B]: computed once per
        step for all the layers that share that window."""
        if id(recent) not in self._limits:
            self._limits[id(recent)] = self.last - recent.view(-1, 1, 1)
        return self._limits[id(recent)]

    def shared(self, values: tuple, device: Any) -> torch.Tensor:
        """One tensor of ``values`` for every layer that asks for the same (their plans' windows and sinks), so
        that per-step quantities made from it are computed once (:meth:`limit`)."""
        key = (values, str(device))
        if key not in self._plans:
            self._plans[key] = torch.tensor(values, dtype=torch.int64, device=device)
        return self._plans[key]

    def rows(self, rows: list[int]) -> Sequences:
        """A copy for the sequences ``rows``."""
        copy = Sequences(self.deferred)
        copy.lengths = None if self.lengths is None else [self.lengths[r] for r in rows]
        copy.columns, copy.longest = self.columns, self.longest
        index = None if self.last is None else torch.tensor(rows, device=self.last.device)
        copy.last = None if self.last is None else self.last[index]
        copy.real = None if self.real is None else self.real[index]
        copy.forwards = self.forwards
        copy.evicted_from = None if self.evicted_from is None else self.evicted_from[index]
        return copy


def starting_scores(policy: Policy, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor:
    """Arriving tokens' scores [B, Hkv, n]: the policy's ``key_scores``, or 0."""
    scores = policy.key_scores(key, position, layer)
    return torch.zeros(position.shape, dtype=torch.float32, device=position.device) if scores is None else scores


def arriving_scores(context: LayerContext, key: torch.Tensor, position: torch.Tensor, layer: int):
    """Arriving tokens' scores [B, Hkv, n] (``key`` [B, Hkv, n, D] at ``position``, broadcast to [B, Hkv, n]) where a
    rule that drops them by a threshold reads them (:func:`starting_scores`); None where nothing reads them."""
    if not context.rule.drops:
        return None
    return starting_scores(context.policy, key, position.expand(*key.shape[:3]), layer)


@dataclass(frozen=True)
class Plan:
    """A layer's budget: ``capacity`` [B, Hkv] per sequence and KV head, the ``recent`` window and ``sinks`` [B]
    per sequence (tensors shared by the layers whose values are equal, :meth:`Sequences.shared`), and whether no
    head can evict any more (``unbounded``: the layer only grows)."""

    capacity: torch.Tensor
    recent: torch.Tensor
    sinks: torch.Tensor
    unbounded: bool

    @classmethod
    def of(cls, capacity: torch.Tensor, recent: torch.Tensor, sinks: torch.Tensor) -> Plan:
        return cls(capacity, recent, sinks, bool((capacity >= UNBOUNDED).all()))

    def with_capacity(self, capacity: torch.Tensor) -> Plan:
        """This plan after a chunk or a compression set the capacities ``capacity``."""
        return Plan.of(capacity, self.recent, self.sinks)

    def rows(self, index: torch.Tensor, shared: Sequences) -> Plan:
        """This plan for the sequences ``index`` [R], its windows and sinks shared through ``shared``."""
        recent, sinks = (shared.shared(tuple(t[index].tolist()), index.device) for t in (self.recent, self.sinks))
        return Plan(self.capacity[index], recent, sinks, self.unbounded)


def plan_tensors(policy: Policy, lengths: list[int], layer: int, context: LayerContext, shared: Sequences, device):
    """One layer's :class:`Plan` for sequences whose budgets apply to ``lengths``."""
    plans = [policy.plan(max(length, 1), layer, context.num_layers) for length in lengths]
    capacity = torch.tensor([p.capacity for p in plans], dtype=torch.int64, device=device)
    return Plan.of(
        capacity.view(-1, 1).expand(-1, context.kv_heads).contiguous(),
        shared.shared(tuple(p.recent for p in plans), device),
        shared.shared(tuple(p.sinks for p in plans), device),
    )


def first_plan(context: LayerContext, sequences: Sequences, layer: int, arriving: torch.Tensor) -> Plan:
    """A layer's capacity per (sequence, KV head), recent window and sinks, fixed on its first chunk (``arriving``
    [B, n] marks its real tokens); the lengths budgets apply to are fixed by the cache's first layer: the context's
    ``length``, or the chunk's real lengths."""
    if sequences.lengths is None:
        length = context.length
        if length is not None:
            sequences.lengths = [length] * arriving.shape[0] if isinstance(length, int) else list(length)
        elif (
            arriving.shape[1] == 1
            and not context.one_forward
            and context.policy.capacity(1) != context.policy.capacity(1 << 20)
        ):
            raise ConfigError("a fraction budget needs a length: give EvictionCache(..., length=N) or a token budget")
        else:
            sequences.lengths = arriving.sum(-1).tolist()
    return plan_tensors(context.policy, sequences.lengths, layer, context, sequences, arriving.device)
