"""The kvpress presses ``kvpress_compare`` runs, and the h2o_eval policy that reproduces each: the catalog behind
its ``--presses``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Press:
    """One kvpress press and the h2o_eval policy that reproduces it."""

    policy: str
    params: dict[str, Any]
    kvpress: Callable[[Any, float], Any]  # (the kvpress module, compression ratio) -> the press
    query_aware: bool = False
    eager: bool = False  # kvpress reads eager attention weights
    delimiter: bool = False  # FINCH: a delimiter token between context and question; the window is the question
    rerotated: bool = False  # the question's positions continue from the compressed length (key re-rotation)
    ties: bool = False  # also run kvpress with ties broken towards the newest token
    layered: bool = False  # the ratio differs by layer (:func:`layer_ratios`): kvpress's PerLayerCompressionPress
    uneven: bool = False  # its layers keep different counts (as ``layered`` ones): kvpress is fed one token at a time
    threshold: bool = False  # DMSPress: the "ratio" is a score threshold (h2o_eval's dms)
    drops: bool = False  # it drops tokens while decoding too (DMSPress(decoding=True); h2o_eval's decoding=evict)
    # A decoding press (``kvpress`` then builds its scorer at the ratio): "size", DecodingPress with target_size
    # int(T (1 - ratio)); "ratio", CompressionRatioDecodingPress at the ratio; "prefill", PrefillDecodingPress, the
    # scorer at the ratio on the context, then DecodingPress with the scorer to the context's kept count.
    decoding: str = ""


def layer_ratios(ratio: float, layers: int) -> list[float]:
    """The compression ratio of each layer of a ``layered`` press at ``ratio``: the ratio in even layers, half of it
    in odd ones."""
    return [ratio if layer % 2 == 0 else ratio / 2 for layer in range(layers)]


SNAPKV_4 = {"window": 4, "kernel_size": 5, "pooling": "avg"}  # the decoding cases' SnapKV: a window of 4


def _scorer(name: str, wrapper: str | None = None, **params: Any) -> Callable[[Any, float], Any]:
    """kvpress's scorer press ``name`` at the ratio with ``params``, inside its ``wrapper`` press if one is named."""

    def make(kv: Any, ratio: float) -> Any:
        press = getattr(kv, name)(compression_ratio=ratio, **params)
        return press if wrapper is None else getattr(kv, wrapper)(press)

    return make


_SNAPKV_4 = _scorer("SnapKVPress", window_size=4, kernel_size=5)


PRESSES: dict[str, Press] = {
    # kvpress's leaderboard entries whose parameters differ from this project's defaults (conf/policy/kvpress/)
    "snapkv": Press("snapkv", {"window": 64, "kernel_size": 5, "pooling": "avg"}, _scorer("SnapKVPress")),
    "pyramidkv": Press(
        "pyramidkv", {"window": 64, "kernel_size": 5, "pooling": "avg", "budgets": "kvpress"},
        _scorer("PyramidKVPress"), uneven=True,
    ),
    "adakv_expected_attention": Press(
        "adakv", {"base": "expected_attention", "epsilon": 0.01},
        _scorer("ExpectedAttentionPress", "AdaKVPress", epsilon=1e-2),
    ),
    "observed_attention": Press("observed_attention", {}, _scorer("ObservedAttentionPress"), eager=True),
    "lagkv": Press("lagkv", {}, _scorer("LagKVPress"), ties=True),
    "cur": Press("cur", {}, _scorer("CURPress"), ties=True),
    "non_causal_attention": Press("non_causal_attention", {}, _scorer("NonCausalAttnPress"), ties=True),
    "leverage": Press("leverage", {}, _scorer("LeverageScorePress"), ties=True),
    "compactor": Press("compactor", {}, _scorer("CompactorPress")),
    "adakv_compactor": Press("adakv", {"base": "compactor"}, _scorer("CompactorPress", "AdaKVPress")),
    "chunkkv": Press(
        "chunkkv", {}, lambda kv, r: kv.ChunkKVPress(press=kv.SnapKVPress(compression_ratio=r), chunk_length=20),
        query_aware=True,
    ),
    "entropy_gated_chunkkv": Press(
        "entropy_gated_chunkkv", {},
        lambda kv, r: kv.EntropyGatedChunkKVPress(press=kv.SnapKVPress(compression_ratio=r)), query_aware=True,
    ),
    "finch": Press("finch", {}, _scorer("FinchPress"), query_aware=True, delimiter=True, rerotated=True),
    "chunk": Press(
        "chunk", {"base": "keydiff", "chunk_length": 128},
        lambda kv, r: kv.ChunkPress(kv.KeyDiffPress(compression_ratio=r), chunk_length=128),
    ),
    "chunk_expected_attention": Press(
        "chunk", {"base": "expected_attention", "chunk_length": 128},
        lambda kv, r: kv.ChunkPress(kv.ExpectedAttentionPress(compression_ratio=r), chunk_length=128),
    ),
    "block": Press(
        "block", {"base": "keydiff"}, lambda kv, r: kv.BlockPress(kv.KeyDiffPress(compression_ratio=r), block_size=128)
    ),
    "per_layer": Press("per_layer", {"base": "keydiff"}, lambda kv, r: kv.KeyDiffPress(), layered=True),
    "composed": Press(
        "composed", {"base": "snapkv", "window": 64, "kernel_size": 5, "pooling": "avg", "then": "keydiff"},
        lambda kv, r: kv.ComposedPress([kv.SnapKVPress(compression_ratio=r), kv.KeyDiffPress(compression_ratio=r)]),
        ties=True,
    ),
    "finch_unrotated": Press(
        "finch", {"rerotate_keys": False}, lambda kv, r: kv.FinchPress(compression_ratio=r, rerotate_keys=False),
        query_aware=True, delimiter=True,
    ),
    "key_rerotation_snapkv": Press(
        "key_rerotation", {"base": "snapkv", "window": 64, "kernel_size": 5, "pooling": "avg"},
        _scorer("SnapKVPress", "KeyRerotationPress"), rerotated=True, ties=True,
    ),
    "key_rerotation_knorm": Press(
        "key_rerotation", {"base": "knorm"}, _scorer("KnormPress", "KeyRerotationPress"), rerotated=True, ties=True
    ),
    "dms_knorm": Press(
        "dms", {"base": "knorm"}, lambda kv, t: kv.DMSPress(kv.KnormPress(), threshold=t), threshold=True
    ),
    "dms_knorm_decoding": Press(
        "dms", {"base": "knorm", "decoding": True},
        lambda kv, t: kv.DMSPress(kv.KnormPress(), threshold=t, decoding=True), threshold=True, drops=True,
    ),
    "dms_keydiff": Press(
        "dms", {"base": "keydiff"}, lambda kv, t: kv.DMSPress(kv.KeyDiffPress(), threshold=t), threshold=True
    ),
    "decoding_snapkv": Press("snapkv", SNAPKV_4, _SNAPKV_4, decoding="size", ties=True),
    **{  # DecodingPress over key scores, the scorers of what is held, and CriticalKV and AdaKV over two of them
        f"decoding_{name}": Press(policy, params, make, eager=name == "observed_attention", decoding="size", ties=True)
        for name, policy, params, make in (
            *((name, name, {}, _scorer(scorer)) for name, scorer in (
                ("knorm", "KnormPress"), ("keydiff", "KeyDiffPress"), ("cur", "CURPress"), ("lagkv", "LagKVPress"),
                ("expected_attention", "ExpectedAttentionPress"), ("observed_attention", "ObservedAttentionPress"))),
            ("criticalkv", "criticalkv", {"base": "keydiff"}, _scorer("KeyDiffPress", "CriticalKVPress")),
            ("adakv", "adakv", {"base": "knorm"}, _scorer("KnormPress", "AdaKVPress")),
            ("adakv_keydiff", "adakv", {"base": "keydiff"}, _scorer("KeyDiffPress", "AdaKVPress")),
        )
    },
    **{  # CompressionRatioDecodingPress and PrefillDecodingPress over Knorm and SnapKV
        f"{mode}_decoding_{name}": Press(name, params, make, decoding=mode, ties=True)
        for mode in ("ratio", "prefill")
        for name, params, make in (("knorm", {}, _scorer("KnormPress")), ("snapkv", SNAPKV_4, _SNAPKV_4))
    },
}  # fmt: skip
