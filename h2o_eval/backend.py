"""The eviction-patched attention backend for transformers 5.

One attention function and one mask function are registered under the name ``h2o_eval``. Inside
:func:`patch`, every forward runs each layer's attention through :mod:`h2o_eval.eviction` (``simulate`` or
``prefill`` protocol); :class:`EvictionCache` is the ``decode`` protocol, a ``Cache`` that physically keeps at
most C entries per KV head. A forward in which any layer bypassed the backend fails loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from h2o_eval.errors import ConfigError
from h2o_eval.eviction import (
    Chunk,
    attend_chunk,
    attend_chunk_reference,
    attend_chunk_triton,
    attend_held,
    claim_slot,
    random_scores,
)
from h2o_eval.policies import Full, H2OReference, Policy, ScoreRule, check_kernels, check_protocol

BACKEND = "h2o_eval"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "opt", "gpt_neox", "gpt2")
# auto: Triton on CUDA tensors, the numba-compiled scan elsewhere; torch: the plain reference loop; triton: forced.
KERNEL_FUNCTIONS = {"auto": attend_chunk, "torch": attend_chunk_reference, "triton": attend_chunk_triton}


def _decode_triton(kernels: str, model: torch.nn.Module) -> bool:
    """Whether decode steps run the Triton kernel: ``auto`` on CUDA, ``triton`` where Triton can run."""
    device = next(model.parameters()).device
    check_kernels(kernels, device.type)
    return kernels == "triton" or (kernels == "auto" and device.type == "cuda")


_last_update: EvictionLayer | None = None


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor:
    """transformers' boolean SDPA mask, always materialised: padding must reach the attention function."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = _last_update
    if layer is not None and layer.pending is not None and layer.pending[0] is key:
        output = layer.attend(module, query, key, value, attention_mask, scaling)
    elif (session := getattr(module, "_h2o_eval_session", None)) is not None:
        output = session.attend(module, query, key, value, attention_mask, scaling)
    else:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(BACKEND, _attention)
AttentionMaskInterface.register(BACKEND, _mask)


def check_supported(model: torch.nn.Module) -> None:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model type {model_type!r} cannot be patched for KV eviction: supported are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def _key_validity(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """[B, length] bool: which of the last ``length`` keys are real tokens (the last query row sees them all)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    return attention_mask[:, 0, -1, -length:].expand(batch, length)


def _plan_tensors(policy: Policy, lengths: list[int], device) -> tuple[torch.Tensor, ...]:
    plans = [policy.plan(max(length, 1)) for length in lengths]
    return tuple(
        torch.tensor([getattr(p, f) for p in plans], dtype=torch.int64, device=device)
        for f in ("capacity", "recent", "sinks")
    )


def _initial_scores(policy: Policy, layer: int, position: torch.Tensor) -> torch.Tensor:
    if policy.rule is ScoreRule.RANDOM:
        return random_scores(policy.seed, layer, position)
    return torch.zeros(position.shape, dtype=torch.float32, device=position.device)


class Session:
    """Per-``patch`` state: the policy, the protocol, per-call context lengths, and capacity statistics."""

    def __init__(self, model: torch.nn.Module, policy: Policy, protocol: str, kernels: str) -> None:
        self.policy, self.protocol, self.kernel = policy, protocol, KERNEL_FUNCTIONS[kernels]
        self.num_layers = model.config.num_hidden_layers
        self.context_lengths: list[int] | None = None
        self.calls: set[int] = set()
        self.capacities: list[tuple[int, int]] = []  # (sequence length the budget applies to, capacity)
        self._layout: dict[str, torch.Tensor] | None = None  # the current forward's plan, shared by its layers

    def start_forward(self) -> None:
        self.calls.clear()
        self._layout = None

    def attend(self, module, query, key, value, attention_mask, scaling) -> torch.Tensor:
        layer_idx = module.layer_idx
        self.calls.add(layer_idx)
        batch, kv_heads, length = key.shape[0], key.shape[1], key.shape[2]
        if query.shape[2] != length:
            raise ConfigError("patch() scores whole sequences: pass no past_key_values (use EvictionCache to decode)")
        valid = _key_validity(attention_mask, batch, length, key.device)
        lengths = valid.sum(-1).tolist()
        if isinstance(self.policy, Full):
            self._record(layer_idx, lengths, lengths)
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)[0].transpose(1, 2)
        if isinstance(self.policy, H2OReference):
            self._record(layer_idx, lengths, [sum(self.policy.budgets(n)) + 1 for n in lengths])
            return h2o_reference_attention(self.policy, query, key, value, valid, scaling)
        if self._layout is None:
            self._layout = self._plan_forward(valid, lengths, kv_heads)
        layout = self._layout
        chunk = Chunk(
            held=torch.zeros(batch, kv_heads, length, dtype=torch.bool, device=key.device),
            arriving=valid,
            position=layout["position"],
            scores=_initial_scores(self.policy, layer_idx, layout["position"]),
            capacity=layout["capacity"],
            recent=layout["recent"],
            sinks=layout["sinks"],
            prefill=layout["prefill"],
            rule=self.policy.rule,
            scaling=scaling,
        )
        return self.kernel(query, key, value, chunk)[0]

    def _plan_forward(self, valid: torch.Tensor, lengths: list[int], kv_heads: int) -> dict[str, torch.Tensor]:
        """Capacities, prefill rows and positions of this forward's sequences (the same in every layer)."""
        batch, length = valid.shape
        if self.protocol == "prefill":
            budget_lengths = self._context_lengths(batch)
            pads_before = (valid.cumsum(-1) == 0).sum(-1)
            prefill = pads_before + torch.tensor(budget_lengths, device=valid.device)
        else:
            budget_lengths, prefill = lengths, torch.zeros(batch, dtype=torch.int64, device=valid.device)
        capacity, recent, sinks = _plan_tensors(self.policy, budget_lengths, valid.device)
        self.capacities.extend(zip(budget_lengths, capacity.tolist(), strict=True))
        position = (valid.cumsum(-1) - 1).clamp(min=0).unsqueeze(1).expand(batch, kv_heads, length).contiguous()
        return {"capacity": capacity, "recent": recent, "sinks": sinks, "prefill": prefill, "position": position}

    def _context_lengths(self, batch: int) -> list[int]:
        if self.context_lengths is None or len(self.context_lengths) != batch:
            raise ConfigError("protocol=prefill needs each sequence's context length: set session.context_lengths")
        return self.context_lengths

    def _record(self, layer_idx: int, lengths: list[int], capacities: list[int]) -> None:
        if layer_idx == 0:
            self.capacities.extend(zip(lengths, capacities, strict=True))

    def capacity_stats(self) -> dict[str, float | int]:
        """Realised capacities over every scored sequence: C, the length it applied to, and the kept share."""
        kept = [min(c, n) for n, c in self.capacities]
        return {
            "sequences": len(self.capacities),
            "length_mean": sum(n for n, _ in self.capacities) / max(len(self.capacities), 1),
            "capacity_mean": sum(kept) / max(len(kept), 1),
            "capacity_min": min(kept, default=0),
            "capacity_max": max(kept, default=0),
            "kept_fraction_mean": sum(k / max(n, 1) for k, (n, _) in zip(kept, self.capacities, strict=True))
            / max(len(kept), 1),
        }

    def check_forward(self) -> None:
        missing = sorted(set(range(self.num_layers)) - self.calls)
        self.calls = set()
        if missing:
            raise RuntimeError(
                f"layers {missing} did not run through the h2o_eval attention backend: this model cannot be "
                "evaluated with eviction (refusing to report unpatched numbers)"
            )


@contextmanager
def patch(
    model: torch.nn.Module, policy: Policy, protocol: str = "simulate", kernels: str = "auto"
) -> Iterator[Session]:
    """Within the block, every forward of ``model`` attends under ``policy`` with ``protocol``.

    ``simulate``: each position attends to what a bounded cache fed token by token from empty would hold.
    ``prefill``: the first ``session.context_lengths[b]`` tokens of sequence b attend in full, the cache is
    compressed to the budget (a fraction of the context), and the rest proceeds with per-step eviction.
    On exit the model is exactly as before.
    """
    check_supported(model)
    check_protocol(policy, protocol, kernels)
    check_kernels(kernels, next(model.parameters()).device.type)
    session = Session(model, policy, protocol, kernels)
    modules = _attention_modules(model)
    previous = model.config._attn_implementation
    hooks = [
        model.register_forward_pre_hook(lambda *_: session.start_forward()),
        model.register_forward_hook(lambda *_: session.check_forward()),
    ]
    for module in modules:
        module._h2o_eval_session = session
    model.set_attn_implementation(BACKEND)
    try:
        yield session
    finally:
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
        for module in modules:
            del module._h2o_eval_session


def h2o_reference_attention(
    policy: H2OReference,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """The H2O authors' lm-eval simulation, per sequence and query head (see :func:`reference_keep_mask`,
    budgets from :meth:`H2OReference.budgets`). Output [B, Hq, T, D]."""
    group = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(group, dim=1)
    values = value.repeat_interleave(group, dim=1)
    output = torch.zeros_like(query)
    for b in range(query.shape[0]):
        n = int(valid[b].sum())
        start = int((valid[b].cumsum(-1) == 0).sum())
        rows = slice(start, start + n)
        logits = torch.matmul(query[b, :, rows], keys[b, :, rows].transpose(-1, -2)) * scaling
        causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        logits = logits.masked_fill(~causal, torch.finfo(logits.dtype).min)
        keep = reference_keep_mask(logits, *policy.budgets(n))
        probs = torch.softmax(logits.masked_fill(~keep, torch.finfo(logits.dtype).min), dim=-1, dtype=torch.float32)
        output[b, :, rows] = torch.matmul(probs.to(values.dtype), values[b, :, rows])
    return output


def reference_keep_mask(logits: torch.Tensor, heavy_budget: int, recent_budget: int) -> torch.Tensor:
    """Which keys each query keeps in the authors' simulation (``local_heavy_hitter_mask`` + recent band).

    ``logits`` [H, T, T] already causal-masked with the dtype minimum. Rows < hb attend causally; each later
    row t keeps the top hb - 1 keys (``torch.topk``) by the accumulated *full* causal softmax of earlier rows,
    plus t; after row t's softmax is added, keys it did not keep get score 0 for good. The band t - rb .. t is
    OR-ed in, then everything is restricted to causal.
    """
    length = logits.shape[-1]
    keep = torch.zeros_like(logits, dtype=torch.bool)
    if heavy_budget > 0:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        accumulated = probs[:, :heavy_budget].sum(dim=-2)
        accumulated[:, heavy_budget:] = 0
        keep[:, :heavy_budget, :heavy_budget] = True
        for token in range(heavy_budget, length):
            top = accumulated.topk(k=heavy_budget - 1, dim=-1).indices
            row = torch.zeros_like(accumulated, dtype=torch.bool).scatter(-1, top, True)
            row[:, token] = True
            keep[:, token] = row
            accumulated = (accumulated + probs[:, token]) * row
    return (keep | torch.ones_like(keep).triu(diagonal=-recent_budget)).tril()


class EvictionLayer(CacheLayerMixin):
    """One layer's bounded cache: keys/values [B, Hkv, S, D] with each slot's held flag, position and score."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: EvictionCache, layer_idx: int) -> None:
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.slot: torch.Tensor | None = None  # [B, Hkv] slot the single arriving token took (decode steps)

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
        global _last_update
        if self.pending is not None:
            raise RuntimeError(
                f"layer {self.layer_idx} did not run through the h2o_eval attention backend: refusing to evict blind"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _last_update = self
        if key_states.shape[2] == 1 and self.seen > 0 and (slot := self._claim(key_states.shape[1])) is not None:
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

    def _claim(self, kv_heads: int) -> torch.Tensor | None:
        owner = self.owner
        now = self.real_seen
        slot = claim_slot(self.held, self.position, self.scores, now, owner.capacity, owner.recent, owner.sinks)
        if slot is None:
            return None
        at = slot.unsqueeze(-1)
        new_position = now.view(-1, 1, 1).expand(-1, kv_heads, 1)
        self.held.scatter_(-1, at, True)
        self.position.scatter_(-1, at, new_position)
        self.scores.scatter_(-1, at, _initial_scores(owner.policy, self.layer_idx, new_position))
        return slot

    def attend(self, module, query, key, value, attention_mask, scaling) -> torch.Tensor:
        global _last_update
        self.pending, _last_update = None, None
        owner = self.owner
        batch, kv_heads, n = key.shape[0], key.shape[1], query.shape[2]
        arriving = _key_validity(attention_mask, batch, n, key.device)
        if self.slot is not None:
            if not bool(arriving.all()):
                raise RuntimeError(
                    "a padding token after the prompt: EvictionCache takes padding only in the first chunk"
                )
            self.slot = None
            output = attend_held(query, key, value, self.held, self.scores, owner.policy.rule, scaling, owner.triton)
            self.seen += 1
            self.real_seen = self.real_seen + 1
            owner.peak_entries = max(owner.peak_entries, int(self.held.sum(-1).max()))
            return output
        first = self.seen == 0
        if first:
            owner.plan(arriving)
        if isinstance(owner.policy, Full):  # nothing is ever evicted: keep every slot, attend like plain SDPA
            self.keys, self.values = key, value
            self.held = torch.cat([self.held, arriving.unsqueeze(1).expand(batch, kv_heads, n)], dim=-1)
            self.seen += n
            owner.peak_entries = max(owner.peak_entries, int(self.held.sum(-1).max()))
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)[0].transpose(1, 2)
        new_position = (self.real_seen.unsqueeze(-1) + arriving.cumsum(-1) - 1).clamp(min=0)
        position = torch.cat([self.position, new_position.unsqueeze(1).expand(batch, kv_heads, n)], dim=-1)
        scores = torch.cat([self.scores, _initial_scores(owner.policy, self.layer_idx, position)[..., -n:]], dim=-1)
        prefill = n if first and owner.protocol == "prefill" else 0
        chunk = Chunk(
            held=torch.cat([self.held, torch.zeros(batch, kv_heads, n, dtype=torch.bool, device=key.device)], -1),
            arriving=arriving,
            position=position.contiguous(),
            scores=scores,
            capacity=owner.capacity,
            recent=owner.recent,
            sinks=owner.sinks,
            prefill=torch.full((batch,), prefill, dtype=torch.int64, device=key.device),
            rule=owner.policy.rule,
            scaling=scaling,
        )
        output, held, scores = owner.kernel(query, key, value, chunk)
        size = int(held.sum(-1).max())
        order = torch.argsort((~held).to(torch.int8), dim=-1, stable=True)[..., :size]
        self.keys = key.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1]))
        self.values = value.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, value.shape[-1]))
        self.held, self.position, self.scores = (
            held.gather(-1, order),
            position.gather(-1, order),
            scores.gather(-1, order),
        )
        self.seen += n
        self.real_seen = self.real_seen + arriving.sum(-1)
        owner.peak_entries = max(owner.peak_entries, int(self.held.sum(-1).max()))
        return output

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.seen, self.pending, self.slot = 0, None, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictionCache does not support beam search")


class EvictionCache(Cache):
    """A transformers ``Cache`` that holds at most C entries per (sequence, layer, KV head).

    ``protocol="simulate"``: the first chunk is fed under per-step eviction from an empty cache;
    ``protocol="prefill"``: the first chunk (the prompt) attends in full and is then compressed to the budget.
    Every later chunk (one token per step when generating) evicts one token per arriving token.
    A fraction budget applies to ``length`` (int or one per sequence) or, if None, to the first chunk's length.
    Creating the cache routes the model's attention through the h2o_eval backend; forwards without an
    EvictionCache and outside :func:`patch` keep the model's plain SDPA attention.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        *,
        protocol: str = "simulate",
        length: int | list[int] | None = None,
        kernels: str = "auto",
    ) -> None:
        check_supported(model)
        if policy.simulate_only:
            raise ConfigError(f"policy {policy.name!r} exists only as a simulation: use patch(..., 'simulate')")
        check_protocol(policy, protocol, kernels)
        self.policy, self.protocol, self.length, self.kernel = policy, protocol, length, KERNEL_FUNCTIONS[kernels]
        self.triton = _decode_triton(kernels, model)
        self.peak_entries = 0
        self.capacity = self.recent = self.sinks = None
        layers = model.config.num_hidden_layers
        super().__init__(layers=[EvictionLayer(self, i) for i in range(layers)])
        model.set_attn_implementation(BACKEND)

    def plan(self, arriving: torch.Tensor) -> None:
        """Fix each sequence's capacity on the first chunk (later layers reuse it)."""
        if self.capacity is not None:
            return
        batch = arriving.shape[0]
        if isinstance(self.policy, Full):
            self.capacity = torch.full((batch,), 2**62, dtype=torch.int64, device=arriving.device)
            self.recent, self.sinks = self.capacity.clone(), torch.zeros_like(self.capacity)
            return
        if self.length is not None:
            lengths = [self.length] * batch if isinstance(self.length, int) else list(self.length)
        elif isinstance(self.policy.budget, float) and arriving.shape[1] == 1:
            raise ConfigError("a fraction budget needs a length: give EvictionCache(..., length=N) or a token budget")
        else:
            lengths = arriving.sum(-1).tolist()
        self.capacity, self.recent, self.sinks = _plan_tensors(self.policy, lengths, arriving.device)

    def kv_bytes(self) -> int:
        """Bytes of keys and values the cache holds now."""
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.is_initialized)
