"""How transformers reaches h2o_eval: the registered attention and mask functions, the hook that hands each attention
call its eviction state, and the checks that a model can be evicted at all.

transformers calls the attention function registered under :data:`BACKEND` with ``(module, query, key, value,
attention_mask, scaling=..., **kwargs)``, where ``kwargs`` are the attention module's own keyword arguments. The
eviction state travels there explicitly: :func:`install` puts a forward pre-hook on every attention module that
looks at the cache the decoder layer hands the module (the ``cache`` argument; ``layer_past`` in GPT-NeoX) and, if
it is an eviction cache (anything with ``eviction_layer``), adds that cache's layer for ``module.layer_idx`` as the
keyword ``eviction`` (and the module's input as ``eviction_input``, from which a policy's scorer may recompute the
queries before rotary embedding), which transformers passes on to the attention function. An attention call
without it is plain SDPA. No state is kept here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

from h2o_eval.errors import ConfigError

BACKEND = "h2o_eval"
# Layer kinds of transformers' ``config.layer_types`` that are softmax attention over a KV cache.
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
# The families the test suite runs every equivalence on (tests/test_backend.py); others are accepted or refused by
# what their attention does (check_supported), not by name.
FAMILIES = "Llama (2, 3), Mistral, Qwen2, Qwen3, Phi-3, Gemma 3, OPT, GPT-NeoX, GPT-2"


def _mask(*args: Any, q_length: int, **kwargs: Any) -> torch.Tensor | None:
    """transformers' boolean SDPA mask. A chunk of several tokens without padding whose keys are its own (a prompt)
    gets none, as under plain SDPA: its causal mask would take T x T bytes (1 GiB at 32k tokens), and the backend
    reads a missing mask as every token real and causal. A one-token causal step that is the last of its keys sees
    every key that is not padding: its mask is the padding mask itself, a view that computes nothing (the general
    path builds it from four index ranges, about ten operations per step), and it is always given, so that
    deciding whether it could be skipped never reads the padding on the host."""
    kv_length, kv_offset, q_offset = kwargs["kv_length"], kwargs.get("kv_offset", 0), kwargs.get("q_offset", 0)
    if (
        q_length == 1
        and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        and kwargs.get("local_size") is None
        and kv_offset == 0
        and isinstance(q_offset, int)
        and q_offset == kv_length - 1
    ):
        padding = prepare_padding_mask(kwargs.get("attention_mask"), kv_length, kv_offset)
        return None if padding is None else padding[:, None, None, :kv_length]
    kwargs["allow_is_causal_skip"] = kwargs.get("allow_is_causal_skip", True) and q_length > 1
    return sdpa_mask(*args, q_length=q_length, **kwargs)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    eviction: Any = None,
    eviction_input: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: the eviction layer's attention when the call carries one, else SDPA."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if eviction is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    output = eviction.attend(module, query, key, value, attention_mask, scaling, hidden_states=eviction_input)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(BACKEND, _attention)
AttentionMaskInterface.register(BACKEND, _mask)


def _route(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """Forward pre-hook of an attention module: the eviction cache among its arguments hands over its layer."""
    for value in kwargs.values():
        if hasattr(value, "eviction_layer"):
            hidden_states = kwargs.get("hidden_states", args[0] if args else None)
            return args, {**kwargs, "eviction": value.eviction_layer(module.layer_idx), "eviction_input": hidden_states}
    return None


def _check(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    """Forward hook of the model's decoder stack (``get_decoder()``): an eviction cache it was given saw every
    layer it fed attend through the backend (a layer whose attention bypasses the interface would otherwise read
    keys nobody evicted from)."""
    for value in kwargs.values():
        if hasattr(value, "check_attended"):
            value.check_attended()


def install(model: torch.nn.Module) -> None:
    """Route ``model``'s attention through the backend: every attention module gets the :func:`_route` hook and
    the model's decoder stack the :func:`_check` hook (once each), and the model the registered attention
    implementation. A forward without an eviction cache stays plain SDPA."""
    for module in attention_modules(model):
        if _route not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_route, with_kwargs=True)
    if _check not in model.get_decoder()._forward_hooks.values():
        model.get_decoder().register_forward_hook(_check, with_kwargs=True)
    model.set_attn_implementation(BACKEND)


def rotary_function(model: torch.nn.Module) -> Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """``cos_sin(layer, positions)``: the (cos, sin) [m, D] the model's rotary embedding gives ``layer`` at the
    positions [m] (Gemma 3's differ between sliding and global layers); None for a model without rotary embedding."""
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        return None
    kinds = getattr(_text_config(model), "layer_types", None)
    typed = "layer_type" in inspect.signature(rotary.forward).parameters
    dtype = next(model.parameters()).dtype

    def cos_sin(layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, dtype=dtype, device=positions.device)
        extra = (kinds[layer],) if typed else ()
        cos, sin = rotary(probe, positions.view(1, -1), *extra)
        return cos[0], sin[0]

    return cos_sin


def host_bound_rotary(model: torch.nn.Module) -> str | None:
    """Why a decode step of ``model`` cannot be captured as a CUDA graph, or None: a dynamic rotary embedding
    (transformers' ``dynamic`` RoPE types) compares the positions with its cached length on the host every forward."""
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    kinds = getattr(rotary, "rope_type", None)
    kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    if any(isinstance(kind, str) and "dynamic" in kind for kind in kinds):
        return "its dynamic rotary embedding reads the positions on the host"
    return None


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
    still bypasses the backend fails at run time (:meth:`h2o_eval.cache.EvictionCache.check_attended`)."""
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
    modules = attention_modules(model)
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
    return windows_of(_text_config(model))


def windows_of(config: Any) -> tuple[list[int | None], int | None]:
    """:func:`layer_windows` from a model's (text) config alone, before any weights load."""
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


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of one token's keys and values over every layer and KV head of ``model``: a full cache's cost."""
    config = _text_config(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_head_count(model) * head_dim * size


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def key_validity(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """[B, length] bool: which of the last ``length`` keys are real tokens. They are the chunk's own tokens, and
    each real one is seen by its own query row (the diagonal), under a causal mask as under a sliding one,
    which cuts the last row short."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    own = attention_mask[:, 0, -length:, -length:].diagonal(dim1=-2, dim2=-1)
    return own.expand(batch, length)
