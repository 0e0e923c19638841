"""kvpress's composition wrappers (``chunk``, ``block``, ``per_layer``, ``composed``) on a tiny Llama, each against a
plain re-implementation of the press written here from kvpress's source over the model's own keys (not by calling
the policy). kvpress 0.5.5 itself is compared on SmolLM2 by ``h2o_eval.benchmarks.kvpress_compare``."""

from __future__ import annotations

import pytest
import torch
from test_scorers import attention_inputs, kept_by_layer

from h2o_eval import EvictionCache, load_model, make_policy
from h2o_eval.errors import ConfigError

LENGTH = 45


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(100, 4000, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    keys = [keys[0] for _, keys, _ in attention_inputs(model, ids)]  # per layer [Hkv, T, D]
    return model, ids, keys


def compressed(model, policy, ids) -> list[list[set[int]]]:
    cache = EvictionCache(model, policy, protocol="prefill", decoding="grow")
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return kept_by_layer(cache)


def keydiff(keys: torch.Tensor) -> torch.Tensor:
    """[Hkv, n] kvpress's KeyDiffPress scores of keys [Hkv, n, D]."""
    anchor = torch.nn.functional.normalize(keys, dim=-1).mean(dim=1, keepdim=True)
    return -torch.nn.functional.cosine_similarity(keys, anchor, dim=-1)


def knorm(keys: torch.Tensor) -> torch.Tensor:
    return -keys.norm(dim=-1)


def test_chunk_compresses_each_chunk_alone_and_concatenates_the_kept_sets(tiny):
    """Chunks of 20, 20 and 5 at 0.5 (rounding down): int(20 * .5) + int(20 * .5) + max(1, int(5 * .5)) = 22, each
    chunk's best by KeyDiff's scores of its own keys (its own mean key)."""
    model, ids, keys = tiny
    kept = compressed(model, make_policy("chunk", 0.5, rounding="down", chunk_length=20), ids)
    for layer, layer_keys in enumerate(keys):
        for head in range(layer_keys.shape[0]):
            expected = set()
            for start in range(0, LENGTH, 20):
                scores = keydiff(layer_keys[head : head + 1, start : start + 20])[0]
                count = max(1, int(scores.numel() * 0.5))
                expected |= {start + j for j in scores.topk(count).indices.tolist()}
            assert len(expected) == 22 and kept[layer][head] == expected, (layer, head)


def test_block_scores_each_block_with_what_was_kept_before_it(tiny):
    """kvpress's BlockPress loop over the keys (kept in its topk order): C = int(45 * 0.4) = 18, blocks of 8."""
    model, ids, keys = tiny
    kept = compressed(model, make_policy("block", 0.4, rounding="down", block_size=8), ids)
    for layer, layer_keys in enumerate(keys):
        for head in range(layer_keys.shape[0]):
            current = torch.arange(18)
            for start in range(18, LENGTH, 8):
                joined = torch.cat([current, torch.arange(start, min(start + 8, LENGTH))])
                current = joined[keydiff(layer_keys[head : head + 1, joined])[0].topk(18).indices]
            assert kept[layer][head] == set(current.tolist()), (layer, head)
    whole = compressed(model, make_policy("keydiff", 0.4, rounding="down"), ids)
    assert kept != whole  # the blocks change the selection


def test_composed_compresses_what_the_first_policy_kept(tiny):
    """knorm at 0.5 keeps int(45 * .5) = 22, then keydiff over those 22 keys keeps int(22 * .6) = 13: C is the
    product of the two budgets, as kvpress's ComposedPress."""
    model, ids, keys = tiny
    policy = make_policy("composed", 0.5, rounding="down", base="knorm", then="keydiff", then_budget=0.6)
    assert policy.capacity(LENGTH) == 13
    assert policy.describe()["second"] == make_policy("keydiff", 0.6, rounding="down").describe()
    kept = compressed(model, policy, ids)
    for layer, layer_keys in enumerate(keys):
        for head in range(layer_keys.shape[0]):
            first = knorm(layer_keys[head]).topk(22).indices
            second = first[keydiff(layer_keys[head : head + 1, first])[0].topk(13).indices]
            assert kept[layer][head] == set(second.tolist()), (layer, head)


def test_per_layer_gives_each_layer_its_own_budget(tiny):
    """Layer 0 at 0.5 and layer 1 at 0.2 (int(45 * b) tokens) of KNorm's best; the policy's budget is their mean."""
    model, ids, keys = tiny
    policy = make_policy("per_layer", 0.9, rounding="down", base="knorm", budgets=[0.5, 0.2])
    assert policy.budget == pytest.approx(0.35) and policy.base.budget == pytest.approx(0.35)
    kept = compressed(model, policy, ids)
    for layer, (budget, layer_keys) in enumerate(zip((0.5, 0.2), keys, strict=True)):
        for head in range(layer_keys.shape[0]):
            expected = set(knorm(layer_keys[head]).topk(int(LENGTH * budget)).indices.tolist())
            assert kept[layer][head] == expected, (layer, head)
    uniform = make_policy("per_layer", 0.5, rounding="down", base="knorm")
    assert compressed(model, uniform, ids) == compressed(model, make_policy("knorm", 0.5, rounding="down"), ids)
    with pytest.raises(ConfigError, match=r"^per_layer: budgets has 3 entries and the model 2 layers: give one"):
        compressed(model, make_policy("per_layer", 0.5, base="knorm", budgets=[0.5, 0.2, 0.1]), ids)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("chunk", {"base": "snapkv"}, r"^chunk: base='snapkv' scores by the attention of the whole prompt"),
        ("block", {"base": "adakv"}, r"^block: base='adakv' is a wrapper: use a scoring policy"),
        ("block", {"block_size": 0}, r"^block: block_size=0: use an integer >= 1$"),
        ("chunk", {"base": "local"}, r"^chunk: base='local' ranks no tokens by score"),
        ("per_layer", {"base": "pyramidkv"}, r"^per_layer: base='pyramidkv' gives its layers capacities of their own"),
        ("per_layer", {"base": "kvzip"}, r"^per_layer: base='kvzip' scores by extra passes and may choose across"),
        ("per_layer", {"budgets": [0.5, 2]}, r"^per_layer: budgets=\[0.5, 2\]: use a list of fractions in \(0, 1\]"),
        ("composed", {"then": "snapkv"}, r"^composed: then='snapkv': use one of compactor, cur, expected_attention"),
        ("composed", {"base": "criticalkv"}, r"^composed: base='criticalkv' is a wrapper"),
        ("adakv", {"base": "chunk"}, r"^adakv: base='chunk' chooses its kept tokens itself and has no scores"),
        ("composed", {"then_budget": 0}, r"^composed: then_budget=0: use a fraction in \(0, 1\] or a token count"),
    ],
)
def test_wrappers_refuse_what_they_cannot_wrap_in_one_line(name, params, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(name, 0.5, **params)
