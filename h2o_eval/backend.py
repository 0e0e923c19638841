"""The eviction-patched attention backend for transformers 5: registration, and :func:`patch`.

One attention function and one mask function are registered under the name ``h2o_eval``. Inside
:func:`patch`, every forward runs each layer's attention through :mod:`h2o_eval.eviction` (``simulate``,
``prefill`` or ``context`` protocol); :class:`h2o_eval.cache.EvictionCache` is the ``decode`` protocol. A forward
in which any layer bypassed the backend fails loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from h2o_eval.errors import ConfigError
from h2o_eval.eviction import Chunk, attend_chunk, attend_chunk_reference, attend_chunk_triton
from h2o_eval.policies import UNBOUNDED, Policy, check_kernels, check_protocol

BACKEND = "h2o_eval"
# Layer kinds of transformers' ``config.layer_types`` that are softmax attention over a KV cache.
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
# The families the test suite runs every equivalence on (tests/test_backend.py); others are accepted or refused by
# what their attention does (check_supported), not by name.
FAMILIES = "Llama (2, 3), Mistral, Qwen2, Qwen3, Phi-3, Gemma 3, OPT, GPT-NeoX, GPT-2"
# auto: Triton on CUDA tensors, the numba-compiled scan elsewhere; torch: the plain reference loop; triton: forced.
KERNEL_FUNCTIONS = {"auto": attend_chunk, "torch": attend_chunk_reference, "triton": attend_chunk_triton}


def kernel_function(kernels: str, device: torch.device):
    """The implementation of the mechanism ``kernels`` names, for tensors on ``device``."""
    if kernels == "auto" and device.type == "cuda":
        return attend_chunk_triton
    return KERNEL_FUNCTIONS[kernels]


class _Routing:
    """The cache layer whose ``update`` just ran: its attention call is the next one (see ``h2o_eval.cache``)."""

    pending: Any = None


routing = _Routing()


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
    layer = routing.pending
    session = getattr(module, "_h2o_eval_session", None)
    if layer is not None and layer.pending is not None and layer.pending[0] is key:
        output = layer.attend(module, query, key, value, attention_mask, scaling)
        if session is not None:  # generating through an EvictionCache inside patch(): this layer evicted
            session.calls.add(module.layer_idx)
    elif session is not None:
        output = session.attend(module, query, key, value, attention_mask, scaling)
    else:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(BACKEND, _attention)
AttentionMaskInterface.register(BACKEND, _mask)


def plain_attention(module, query, key, value, attention_mask, scaling) -> torch.Tensor:
    """The model's own SDPA attention [B, Hq, n, D]: what a cache that evicts nothing computes. The backend always
    materialises the mask (padding must reach it); a square boolean mask whose last row sees every key has no
    padding and no window cut, so it is plain causal and goes to SDPA's causal kernel, as transformers sends an
    unpadded batch (at 8k tokens the masked kernel takes 1.7x as long)."""
    if (
        attention_mask is not None
        and attention_mask.dtype == torch.bool
        and query.shape[2] == key.shape[2] > 1
        and bool(attention_mask[..., -1, :].all())
    ):
        attention_mask = None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)[0].transpose(1, 2)


def _text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_supported(model: torch.nn.Module) -> None:
    """Refuse, in one line, a model whose attention eviction cannot reproduce: what decides is not the model's
    name but whether its attention goes through transformers' AttentionInterface (un-repeated K/V, a layer
    index per module), is plain softmax attention, and has no logit soft-capping. A forward in which a layer
    still bypasses the backend fails at run time (``Session.check_forward``)."""
    config = _text_config(model)
    refused = f"model type {getattr(config, 'model_type', None)!r} cannot be patched for KV eviction: "
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYERS))
    if other:
        raise ConfigError(
            refused + f"its {', '.join(other)} layers hold no softmax KV cache; use a model of attention layers only"
        )
    if not type(model).is_backend_compatible():
        raise ConfigError(
            refused + f"its attention does not go through transformers' AttentionInterface; use one of {FAMILIES}"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ConfigError(
            refused + "it soft-caps attention logits, which the eviction softmax does not; use a model without "
            "attn_logit_softcapping (Gemma 3 rather than Gemma 2)"
        )
    modules = _attention_modules(model)
    if len(modules) != config.num_hidden_layers:
        raise ConfigError(
            refused + f"{len(modules)} attention modules with a layer index for {config.num_hidden_layers} layers; "
            f"use one of {FAMILIES}"
        )


def layer_windows(model: torch.nn.Module) -> tuple[list[int | None], int | None]:
    """How sliding-window layers are treated: (per layer, the window W of a sliding layer that keeps its own
    cache, or None for a layer the policy compresses; the window that bounds every layer when the model has no
    global layer, else None).

    In a model that mixes sliding and global layers (Gemma 3, Qwen2/3 with ``max_window_layers``), a sliding
    layer keeps exactly what the model's own mask gives it, its last W tokens, and the policy compresses the
    global layers, as kvpress does for Gemma 3. In a model whose every layer slides (Mistral v0.1, Phi-3 with
    ``sliding_window`` set; no ``layer_types``) the policy compresses every layer, and a sequence longer than W
    is refused.
    """
    config = _text_config(model)
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if not kinds or all(kind == "sliding_attention" for kind in kinds):
        return [None] * config.num_hidden_layers, window
    return [window if kind == "sliding_attention" else None for kind in kinds], None


def check_window(window: int | None, length: int) -> None:
    if window is not None and length > window:
        raise ConfigError(
            f"a sequence of {length} tokens is longer than the sliding window ({window}) of every layer of this "
            f"model: eviction inside a sliding window is not supported; keep sequences to at most {window} tokens"
        )


def check_kv_heads(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kv_heads: int) -> None:
    """The attention call got K/V un-repeated: one head per KV head of the model (GQA groups scored together)."""
    if key.shape[1] != kv_heads or query.shape[1] % kv_heads:
        raise ConfigError(
            f"layer {module.layer_idx} passed K/V with {key.shape[1]} heads for {kv_heads} KV heads and "
            f"{query.shape[1]} query heads: eviction scores un-repeated K/V; use a model that does not repeat them"
        )


def kv_head_count(model: torch.nn.Module) -> int:
    config = _text_config(model)
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def key_validity(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """[B, length] bool: which of the last ``length`` keys are real tokens. They are the chunk's own tokens, and
    each real one is seen by its own query row (the diagonal), under a causal mask as under a sliding one,
    which cuts the last row short."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    own = attention_mask[:, 0, -length:, -length:].diagonal(dim1=-2, dim2=-1)
    return own.expand(batch, length)


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


class Session:
    """Per-``patch`` state: the policy, the protocol, per-call context lengths, and capacity statistics."""

    def __init__(self, model: torch.nn.Module, policy: Policy, protocol: str, kernels: str) -> None:
        self.policy, self.protocol = policy, protocol
        self.kernel = kernel_function(kernels, next(model.parameters()).device)
        self.num_layers = _text_config(model).num_hidden_layers
        self.kv_heads = kv_head_count(model)
        self.windows, self.window = layer_windows(model)
        self.context_lengths: list[int] | None = None
        self.calls: set[int] = set()
        self.capacities: list[tuple[int, float]] = []  # (length the budget applies to, mean C over layers, heads)
        self.layer_kept: dict[int, list[float]] = {}  # layer -> realised C per sequence (mean over KV heads)
        self.head_spread: list[int] = []  # per (sequence, layer): most minus fewest tokens kept by a KV head
        self._forward: dict[str, Any] | None = None  # the current forward's layout, shared by its layers

    def start_forward(self) -> None:
        self.calls.clear()
        self._forward = None

    def attend(self, module, query, key, value, attention_mask, scaling) -> torch.Tensor:
        layer = module.layer_idx
        self.calls.add(layer)
        batch, kv_heads, length = key.shape[0], key.shape[1], key.shape[2]
        if query.shape[2] != length:
            raise ConfigError("patch() scores whole sequences: pass no past_key_values (use EvictionCache to decode)")
        check_kv_heads(module, query, key, self.kv_heads)
        valid = key_validity(attention_mask, batch, length, key.device)
        if self._forward is None:
            self._forward = self._start(valid)
        forward = self._forward
        if (window := self.windows[layer]) is not None:  # a sliding layer keeps its own window (see layer_windows)
            lengths = torch.tensor(forward["budget_lengths"], device=key.device).view(-1, 1)
            self._record(layer, forward, lengths.clamp(max=window).expand(batch, kv_heads))
            return plain_attention(module, query, key, value, attention_mask, scaling)
        plan = plan_tensors(self.policy, forward["budget_lengths"], layer, self.num_layers, kv_heads, key.device)
        own = self.policy.attention(query, key, value, valid, scaling)
        if own is not None:
            self._record(layer, forward, plan["capacity"])
            return own
        limit = torch.tensor(forward["evict_lengths"], device=key.device).view(-1, 1)
        if bool((plan["capacity"] >= limit).all()):  # nothing can be evicted: this is plain attention
            self._record(layer, forward, plan["capacity"])
            return plain_attention(module, query, key, value, attention_mask, scaling)
        position = forward["position"].expand(batch, kv_heads, length).contiguous()
        chunk = Chunk(
            held=torch.zeros(batch, kv_heads, length, dtype=torch.bool, device=key.device),
            arriving=valid,
            position=position,
            scores=starting_scores(self.policy, key, position, layer),
            capacity=plan["capacity"],
            recent=plan["recent"],
            sinks=plan["sinks"],
            prefill=forward["prefill"],
            rule=self.policy.rule,
            scaling=scaling,
        )
        result = self.kernel(query, key, value, chunk)
        self._record(layer, forward, plan["capacity"] if result.kept is None else result.kept)
        return result.output

    def _start(self, valid: torch.Tensor) -> dict[str, Any]:
        """This forward's sequences: budget lengths, prefill rows, positions (the same in every layer), and the
        length past which a capacity would evict."""
        batch, length = valid.shape
        lengths = valid.sum(-1).tolist()
        check_window(self.window, max(lengths))
        if self.protocol == "simulate":
            budget_lengths, prefill = lengths, torch.zeros(batch, dtype=torch.int64, device=valid.device)
        else:
            budget_lengths = self._context_lengths(batch)
            pads_before = (valid.cumsum(-1) == 0).sum(-1)
            prefill = pads_before + torch.tensor(budget_lengths, device=valid.device)
        # A rule that grows keeps everything after its prompt: only the prompt can overflow C.
        evict_lengths = budget_lengths if self.policy.rule.grows else lengths
        position = (valid.cumsum(-1) - 1).clamp(min=0).unsqueeze(1)
        return {
            "budget_lengths": budget_lengths,
            "evict_lengths": evict_lengths,
            "prefill": prefill,
            "position": position,
            "kept": [],
        }

    def _context_lengths(self, batch: int) -> list[int]:
        if self.context_lengths is None or len(self.context_lengths) != batch:
            raise ConfigError(
                f"protocol={self.protocol} needs each sequence's context length: set session.context_lengths"
            )
        return self.context_lengths

    def _record(self, layer: int, forward: dict[str, Any], capacity: torch.Tensor) -> None:
        """Realised C of this layer per sequence and head: its capacity, at most the length it applies to."""
        lengths = torch.tensor(forward["budget_lengths"], device=capacity.device).view(-1, 1)
        kept = torch.minimum(capacity, lengths.clamp(min=1)).float()
        self.layer_kept.setdefault(layer, []).extend(kept.mean(-1).tolist())
        self.head_spread.extend((kept.amax(-1) - kept.amin(-1)).long().tolist())
        forward["kept"].append(kept.mean(-1))

    def capacity_stats(self) -> dict[str, Any]:
        """Realised capacities over every scored sequence: C (mean over layers and KV heads), the length it
        applied to, the kept share, each layer's mean C, and how unevenly KV heads were filled."""
        kept = [c for _, c in self.capacities]
        count = max(len(kept), 1)
        return {
            "sequences": len(self.capacities),
            "length_mean": sum(n for n, _ in self.capacities) / count,
            "capacity_mean": sum(kept) / count,
            "capacity_min": min(kept, default=0),
            "capacity_max": max(kept, default=0),
            "kept_fraction_mean": sum(c / max(n, 1) for n, c in self.capacities) / count,
            "layer_capacity_mean": [sum(values) / max(len(values), 1) for _, values in sorted(self.layer_kept.items())],
            "head_spread_mean": sum(self.head_spread) / max(len(self.head_spread), 1),
        }

    def check_forward(self) -> None:
        missing = sorted(set(range(self.num_layers)) - self.calls)
        self.calls = set()
        if missing:
            raise RuntimeError(
                f"layers {missing} did not run through the h2o_eval attention backend: this model cannot be "
                "evaluated with eviction (refusing to report unpatched numbers)"
            )
        if self._forward is not None and self._forward["kept"]:
            per_layer = torch.stack(self._forward["kept"]).mean(0).tolist()
            self.capacities.extend(zip(self._forward["budget_lengths"], per_layer, strict=True))


@contextmanager
def patch(
    model: torch.nn.Module, policy: Policy, protocol: str = "simulate", kernels: str = "auto"
) -> Iterator[Session]:
    """Within the block, every forward of ``model`` attends under ``policy`` with ``protocol``.

    ``simulate``: each position attends to what a bounded cache fed token by token from empty would hold.
    ``prefill`` and ``context``: the first ``session.context_lengths[b]`` tokens of sequence b attend in full,
    the cache is compressed to the budget (a fraction of those tokens), and the rest proceeds under the policy's
    decoding rule. (The two differ in what the caller counts as the context: the whole prompt, or only what
    precedes the question.) On exit the model is exactly as before.
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


__all__ = ["BACKEND", "UNBOUNDED", "Session", "check_supported", "layer_windows", "patch"]
