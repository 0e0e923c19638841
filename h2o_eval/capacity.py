"""What a run's caches held: :class:`CapacityLog` reads the realised capacities off every cache a runner used, the
same way whatever the runner, into the record's ``capacity``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from h2o_eval.cache import EvictionCache, Statistics


class CapacityLog:
    """The realised capacities of every sequence scored in a run, read off its caches the same way whatever the
    runner: per sequence the length its budget applied to and, per layer, the tokens each KV head kept."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.layers: list[list[float]] = []  # per sequence: each layer's C, mean over KV heads
        self.spreads: list[int] = []  # per (sequence, layer): most minus fewest tokens kept by a KV head
        self.entries: list[float] = []  # per sequence: KV entries kept, summed over layers and KV heads
        self.entry_bytes = 0

    def state(self) -> dict[str, Any]:
        """What it logged, as JSON's types (:meth:`from_state` makes it again)."""
        return dict(vars(self))

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> CapacityLog:
        log = cls()
        vars(log).update(state)
        return log

    def add(self, cache: EvictionCache | Statistics) -> list[float]:
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
        it applied to, the kept share, each layer's mean C and kept share, how unevenly KV heads were filled, and
        the bytes of keys and values kept per sequence. Under a threshold (``dms``) the kept shares are the ratio
        it realised (1 - kvpress's compression ratio)."""
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
            "layer_kept_fraction_mean": [
                sum(c / max(n, 1) for n, c in zip(self.lengths, values, strict=True)) / len(values)
                for values in by_layer
            ],
            "head_spread_mean": sum(self.spreads) / max(len(self.spreads), 1),
            "kv_bytes_mean": sum(self.entries) / count * self.entry_bytes,
        }
