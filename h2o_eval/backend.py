"""Whole-sequence forwards under eviction: :func:`patch` (the ``simulate``, ``prefill`` and ``context`` protocols).

Inside ``patch``, each forward of the model gets a fresh :class:`~h2o_eval.cache.EvictionCache` that serves that
forward alone: the sequence is its first chunk (under ``simulate`` every row arrives under per-step eviction from an
empty cache; under ``prefill``/``context`` the first ``session.context_lengths[b]`` real tokens are a prompt that
attends in full and is compressed, the rest arrive under the decoding rule). The logits are what a cache fed token
by token would give. A forward that brings its own EvictionCache (``generate`` inside ``patch``) keeps it. After
each forward the capacities the cache realised are logged (:class:`~h2o_eval.capacity.CapacityLog`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache

from h2o_eval.attention import check_supported, install
from h2o_eval.cache import EvictionCache
from h2o_eval.capacity import CapacityLog
from h2o_eval.errors import ConfigError
from h2o_eval.policies import Interval, Policy, check_decoding, check_kernels, check_protocol


class Session:
    """Per-``patch`` state: the policy, the protocol, the context length of each sequence of the next forward
    (``context_lengths``, set by the caller under ``prefill`` and ``context``) and the capacities realised so far."""

    def __init__(
        self, model: torch.nn.Module, policy: Policy, protocol: str, kernels: str, decoding: str, interval=None
    ) -> None:
        self.policy, self.protocol, self.kernels, self.decoding = policy, protocol, kernels, decoding
        self.interval: Interval | None = interval
        self.context_lengths: list[int] | None = None
        self.capacity = CapacityLog()
        self._cache: EvictionCache | None = None

    def before(self, model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        """Forward pre-hook of the model's decoder stack (``get_decoder()``, which the causal LM calls with its
        ``cache``, and which a caller may call alone): hand the forward a fresh one-forward EvictionCache as its
        ``cache`` (unless it brings its own)."""
        caches = [value for value in kwargs.values() if isinstance(value, Cache)]
        if any(hasattr(cache, "eviction_layer") for cache in caches):
            return None
        if caches:
            raise ConfigError("patch() scores whole sequences: pass no cache (use EvictionCache to decode)")
        lengths = None
        if self.protocol != "simulate":
            if self.context_lengths is None:
                raise ConfigError(
                    f"protocol={self.protocol} needs each sequence's context length: set session.context_lengths"
                )
            lengths = list(self.context_lengths)
        self._cache = EvictionCache(
            model,
            self.policy,
            protocol=self.protocol,
            length=lengths,
            prompt=lengths,
            kernels=self.kernels,
            one_forward=True,
            decoding=self.decoding,
            interval=self.interval,
        )
        return args, {**kwargs, "cache": self._cache, "use_cache": True}

    def after(self, model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        """Forward hook: every layer attended through the cache; log what it realised."""
        cache, self._cache = self._cache, None
        if cache is None:
            return
        missing = [layer.layer_idx for layer in cache.layers if layer.seen == 0]
        if missing:
            raise RuntimeError(
                f"layers {missing} did not run through the h2o_eval attention backend: this model cannot be "
                "evaluated with eviction (refusing to report unpatched numbers)"
            )
        self.capacity.add(cache)

    def capacity_stats(self) -> dict[str, Any]:
        """Realised capacities over every scored sequence (:meth:`h2o_eval.capacity.CapacityLog.stats`)."""
        return self.capacity.stats()


@contextmanager
def patch(
    model: torch.nn.Module,
    policy: Policy,
    protocol: str = "simulate",
    kernels: str = "auto",
    decoding: str = "evict",
    interval: Interval | None = None,
) -> Iterator[Session]:
    """Within the block, every forward of ``model`` attends under ``policy`` with ``protocol``.

    ``simulate``: each position attends to what a bounded cache fed token by token from empty would hold.
    ``prefill`` and ``context``: the first ``session.context_lengths[b]`` tokens of sequence b attend in full,
    the cache is compressed to the budget (a fraction of those tokens), and the rest proceeds under the policy's
    decoding rule (``decoding="grow"``: nothing evicted after the compression; ``"interval"`` with ``interval``'s
    settings: compressed between forwards, as what the session generates is). (The two differ in what the caller
    counts as the context: the whole prompt, or only what precedes the question.) On exit the model is exactly as
    before.
    """
    check_supported(model)
    check_protocol(policy, protocol, kernels)
    check_decoding(protocol, decoding, policy)
    check_kernels(kernels, next(model.parameters()).device.type)
    session = Session(model, policy, protocol, kernels, decoding, interval)
    previous = model.config._attn_implementation
    install(model)
    hooks = [
        model.get_decoder().register_forward_pre_hook(session.before, with_kwargs=True),
        model.get_decoder().register_forward_hook(session.after, with_kwargs=True),
    ]
    try:
        yield session
    finally:
        for hook in hooks:
            hook.remove()
        model.set_attn_implementation(previous)


__all__ = ["Session", "patch"]
