"""Several :class:`~h2o_eval.cache.EvictionCache` s fed as one: :class:`SharedPrompt` feeds one prompt to the caches
of several policies, its attention computed once; :class:`StackedCache` answers one question batch from several
compressed caches (:meth:`~h2o_eval.cache.EvictionCache.stack`).

Both take the caches' layers as they are and call their ``update`` and ``attend``: nothing here knows more of a
cache than its layers."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_eval.attention import plain_attention
from h2o_eval.errors import ConfigError
from h2o_eval.layer import EvictionLayer


class LayersOfCaches(CacheLayerMixin):
    """One layer of several caches fed as one: ``layers``, one per cache, all having seen the same tokens."""

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
    """One layer of a :class:`StackedCache`: each cache's rows of a chunk go to that cache's layer, which takes
    them and attends as it would alone; the outputs are the rows in order."""

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


class StackedCache(Cache):
    """One cache whose sequences are those of ``views`` in order (compressed caches under ``decoding=grow``, as
    :meth:`~h2o_eval.cache.EvictionCache.grown_view` s, all fed the same tokens), for feeding them the same tokens
    in one batch. Each layer hands each cache's rows to that cache's layer, which attends to what it holds as it
    would alone, over its own slots only; what is batched is the rest of the model. The caches the views were made
    of are left as they were."""

    deferred = False

    def __init__(self, views: list[Any]) -> None:
        if len({tuple(layer.seen for layer in view.layers) for view in views}) != 1:
            raise ValueError("the caches have seen different tokens: only caches fed the same tokens are stacked")
        rows = [len(view.lengths) for view in views]
        super().__init__(
            layers=[StackedLayer([view.layers[i] for view in views], rows) for i in range(len(views[0].layers))]
        )
        self.views = views
        self.lengths = [length for view in views for length in view.lengths]

    def eviction_layer(self, layer: int) -> StackedLayer:
        return self.layers[layer]

    def rows(self, keep: list[int]) -> StackedCache:
        """These caches' sequences ``keep`` (increasing indices over the stack) stacked again, to go on with those
        alone: a view that keeps all its sequences goes on as it is (this stack is not fed again), one that keeps
        some goes on as a :meth:`~h2o_eval.cache.EvictionCache.fork` of them, and one that keeps none leaves."""
        views, start = [], 0
        for view in self.views:
            count = len(view.lengths)
            if own := [row - start for row in keep if start <= row < start + count]:
                views.append(view if len(own) == count else view.fork(own))
            start += count
        return StackedCache(views)

    def check_attended(self) -> None:
        for layer in self.layers:
            layer.check_attended()

    def check_faults(self) -> None:
        for view in self.views:
            view.check_faults()


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
    """Feeds one first chunk (a prompt, or a context) to several empty :class:`~h2o_eval.cache.EvictionCache` s of
    one model at once. In the ``prefill`` and ``context`` protocols that chunk attends in full whatever the policy,
    so its attention is computed once (as the full cache computes it), while each cache scores and compresses it by
    its own policy; the caches then go on alone. Decoding through a ``SharedPrompt`` is refused: the policies part
    there."""

    def __init__(self, caches: list[Any]) -> None:
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
