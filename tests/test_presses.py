"""The kvpress presses reproduced as policies: each scorer by hand on tiny tensors, and each policy on a tiny Llama
against the press's formula written here from kvpress's source and the papers (not by calling the policy).
kvpress 0.5.5 itself is compared on SmolLM2 by ``h2o_eval.benchmarks.kvpress_compare`` (docs/policies.md, "Against
kvpress")."""

from __future__ import annotations

import math

import pytest
import torch
from test_scorers import attention_inputs, kept_by_layer, prompt_of, top
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from h2o_eval import EvictionCache, load_model, make_policy
from h2o_eval.errors import ConfigError
from h2o_eval.policies import POLICIES, Plan
from h2o_eval.policies.entropy_gated_chunkkv import gated_selection
from h2o_eval.policies.leverage import gaussian_sketch

LENGTH = 40


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", device="cpu")


@pytest.fixture(scope="module")
def observed(tiny):
    """The tiny Llama on a 40-token prompt: per layer its attention input, keys, values, queries after rotary
    embedding, and the eager attention weights [Hq, T, T]."""
    model, _ = tiny
    ids = torch.randint(100, 4000, (1, LENGTH), generator=torch.Generator().manual_seed(8))
    inputs = attention_inputs(model, ids)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            weights = model(ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    heads = model.config.num_attention_heads
    dim = model.config.hidden_size // heads
    cos, sin = model.model.rotary_emb(inputs[0][0], torch.arange(LENGTH).view(1, -1))
    layers = []
    for layer, (hidden, keys, values) in enumerate(inputs):
        with torch.no_grad():
            query = model.model.layers[layer].self_attn.q_proj(hidden).view(1, LENGTH, heads, dim).transpose(1, 2)
        query, _ = apply_rotary_pos_emb(query, query, cos, sin)
        layers.append({"hidden": hidden[0], "keys": keys[0], "values": values[0], "query": query[0],
                       "weights": weights[layer][0]})  # fmt: skip
    return ids, layers


def compressed(model, policy, ids) -> list[list[set[int]]]:
    """The positions each (layer, KV head) keeps after ``ids`` are compressed as one prompt."""
    cache = EvictionCache(model, policy, protocol="prefill")
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return kept_by_layer(cache)


def scores_of(policy, prompt, votes=None) -> torch.Tensor:
    shape = prompt.key.shape[:-1]
    votes = torch.zeros(shape) if votes is None else votes
    return policy.compression_scores(prompt, votes, torch.zeros(shape, dtype=torch.bool))


# Plans and parameters.


@pytest.mark.parametrize(
    ("name", "params", "length", "plan"),
    [
        ("observed_attention", {}, 100, Plan(capacity=20, recent=0)),
        ("lagkv", {}, 100, Plan(capacity=20, recent=16, sinks=4)),  # shorter than 4 + 2 * 128: sinks + newest
        ("lagkv", {}, 2000, Plan(capacity=400, recent=128 + 1996 % 128, sinks=4)),  # the last partition + the rest
        ("lagkv", {}, 1000, Plan(capacity=200, recent=200, sinks=0)),  # C below sinks + tail (232): the newest
        ("cur", {}, 100, Plan(capacity=20, recent=0, sinks=4)),
        ("non_causal_attention", {}, 100, Plan(capacity=20, recent=0)),
        ("leverage", {}, 100, Plan(capacity=20, recent=0)),
        ("compactor", {}, 100, Plan(capacity=20, recent=4, sinks=8)),
        ("compactor", {}, 30, Plan(capacity=6, recent=0, sinks=6)),
        ("adakv", {"base": "compactor"}, 100, Plan(capacity=20, recent=4, sinks=8)),
        # 100 tokens: 5 chunks of 20, one kept; 1030 tokens: 52 chunks (the last of 10 tokens, inside SnapKV's
        # window of 64, so always kept): ceil(52 * 0.2) = 11 chunks, 10 * 20 + 10 tokens.
        ("chunkkv", {}, 100, Plan(capacity=20, recent=0)),
        ("chunkkv", {}, 1030, Plan(capacity=210, recent=0)),
        ("chunkkv", {"base": "knorm"}, 1030, Plan(capacity=220, recent=0)),  # no protected end: full chunks
        ("entropy_gated_chunkkv", {}, 1030, Plan(capacity=206, recent=0)),
        ("finch", {}, 1000, Plan(capacity=200, recent=64)),
        ("finch", {"window": 8}, 100, Plan(capacity=20, recent=8)),
    ],
)
def test_plans(name, params, length, plan):
    assert make_policy(name, budget=0.2, **params).plan(length) == plan


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("lagkv", {"lag_size": 0}, r"^lagkv: lag_size=0: use an integer >= 1$"),
        ("lagkv", {"cross_scoring": 1}, r"^lagkv: cross_scoring=1: use true or false$"),
        ("cur", {"leverage_type": "both"}, r"^cur: leverage_type='both': use one of key, value, kv_avg, kv_product$"),
        ("cur", {"local_window_size": 0}, r"local_window_size=0: use an integer >= 1$"),
        ("leverage", {"sketch_dimension": 0}, r"^leverage: sketch_dimension=0: use an integer >= 1$"),
        ("non_causal_attention", {"chunk_size": 0}, r"chunk_size=0: use an integer >= 1$"),
        ("compactor", {"blending": -1}, r"^compactor: blending=-1: use a number >= 0$"),
        ("compactor", {"sink_size_end": -1}, r"sink_size_end=-1: use an integer >= 0$"),
        ("chunkkv", {"chunk_length": 0}, r"^chunkkv: chunk_length=0: use an integer >= 1$"),
        ("chunkkv", {"base": "adakv"}, r"^chunkkv: base='adakv' is a wrapper: chunkkv chooses by a scoring policy"),
        ("chunkkv", {"base": "local"}, r"^chunkkv: base='local' ranks no tokens by score"),
        ("entropy_gated_chunkkv", {"low_entropy_chunk_length": 10}, r"use fewer than chunk_length=10$"),
        ("finch", {"window": 0}, r"^finch: window=0: use an integer >= 1$"),
        ("finch", {"normalize_scores": "yes"}, r"^finch: normalize_scores='yes': use true or false$"),
    ],
)
def test_every_parameter_is_checked_in_one_line(name, params, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(name, budget=0.2, **params)


# Observed attention, and how it differs from H2O.


def test_observed_attention_averages_over_the_rows_that_saw_each_token():
    """Votes 2, 1.5, 1 (one query head) after a padding column: the three real rows saw token 0, two saw token 1,
    one saw token 2, so the averages 2/3, 3/4, 1 rank the tokens the other way round from H2O's sums."""
    prompt = prompt_of([[[1.0], [1.0], [1.0], [1.0]]], real=[False, True, True, True])
    votes = torch.tensor([[[0.0, 2.0, 1.5, 1.0]]])
    scores = scores_of(make_policy("observed_attention", 2), prompt, votes)
    torch.testing.assert_close(scores[0, 0, 1:], torch.tensor([2 / 3, 3 / 4, 1.0]))
    assert scores[0, 0, 1:].argsort().tolist() == votes[0, 0, 1:].argsort(descending=True).tolist()


def test_observed_attention_keeps_the_best_averages_where_h2o_keeps_sums_and_a_window(tiny, observed):
    """Reference: the model's eager attention weights summed over the prompt's rows, divided by 40 - j (the rows
    that saw token j), averaged over the KV head's query heads; the best 12 are kept. H2O at the same budget keeps
    its 6 newest tokens and the 6 best column sums: a different choice in every head here."""
    model, _ = tiny
    ids, layers = observed
    mine = compressed(model, make_policy("observed_attention", 0.3), ids)
    h2o = compressed(model, make_policy("h2o", 0.3), ids)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, seen in enumerate(layers):
        for head in range(model.config.num_key_value_heads):
            sums = seen["weights"][head * group : (head + 1) * group].double().sum(dim=(0, 1))
            averages = sums / torch.arange(LENGTH, 0, -1) / group
            assert mine[layer][head] == top(averages, 12, set()), (layer, head)
            assert h2o[layer][head] == top(sums, 12, set(range(34, 40)))
            assert mine[layer][head] != h2o[layer][head]


# LagKV.


def lag_reference(states: torch.Tensor, n_sink: int, lag: int) -> torch.Tensor:
    """[n] one head's LagKV token scores before ranking (0 on the sinks and the tail): partition p's tokens
    min-max normalised per channel by partition p + 1, their channels' standard deviation softmaxed over p."""
    n = states.shape[0]
    partitions = (n - n_sink) // lag
    scores = torch.zeros(n, dtype=torch.float64)
    for p in range(partitions - 1):
        start = n_sink + p * lag
        tokens, reference = states[start : start + lag].double(), states[start + lag : start + 2 * lag].double()
        low, high = reference.min(0).values, reference.max(0).values
        spread = torch.stack([((token - low) / (high - low)).std() for token in tokens])
        scores[start : start + lag] = torch.softmax(spread, 0)
    return scores


@pytest.mark.parametrize("cross_scoring", [False, True])
def test_lagkv_scores_each_partition_against_the_next(cross_scoring):
    """One sink, partitions of 3, 12 tokens: partitions 1-3, 4-6 and 7-9, then 10-11; tokens 1-6 are scored (the
    key's and value's scores averaged, ranked within the partition over 3), the sink and the last 5 score 1."""
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 12, 5, generator=gen), torch.randn(2, 12, 5, generator=gen)
    policy = make_policy("lagkv", 0.5, n_sink=1, lag_size=3, cross_scoring=cross_scoring)
    assert policy.plan(12) == Plan(capacity=6, recent=5, sinks=1)
    scores = scores_of(policy, prompt_of(keys, values))[0]
    for head in range(2):
        expected = (lag_reference(keys[head], 1, 3) + lag_reference(values[head], 1, 3)) / 2
        if not cross_scoring:
            for start in (1, 4):
                expected[start : start + 3] = expected[start : start + 3].argsort().argsort() / 3
        expected[0], expected[7:] = 1.0, 1.0
        torch.testing.assert_close(scores[head].double(), expected)


# Leverage scores.


def leverage_reference(keys: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """[H, m] z-normalised leverage scores diag(X (X^T X + 0.01 I)^-1 X^T) of X = centred keys [H, m, D] times
    ``sketch`` [H, D, k] (kvpress's Cholesky with its first jitter, 0.01), in float64."""
    x = (keys - keys.mean(1, keepdim=True)).double() @ sketch.double()
    gram = x.transpose(1, 2) @ x + 0.01 * torch.eye(x.shape[-1], dtype=torch.float64)
    scores = torch.einsum("hmk,hkl,hml->hm", x, torch.linalg.inv(gram), x).clamp(min=0)
    return (scores - scores.mean()) / scores.std()


def kvpress_sketch(seed: int, layer: int, heads: int, dim: int, columns: int) -> torch.Tensor:
    """[H, D, k] what kvpress draws for ``layer`` after torch.manual_seed(seed): one randn(1, H, D, k) per layer."""
    torch.manual_seed(seed)
    for _ in range(layer + 1):
        drawn = torch.randn(1, heads, dim, columns)
    return drawn[0] / math.sqrt(columns)


def test_leverage_scores_by_its_definition_with_kvpress_sketch():
    """A model without rotary embedding: the keys are the pre-rotary keys; layer 2's sketch is kvpress's third
    draw after torch.manual_seed(seed)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 12, 4, generator=gen) * torch.tensor([1.0, 3.0, 0.5, 2.0])
    prompt = prompt_of(keys)
    prompt.layer = 2
    scores = scores_of(make_policy("leverage", 0.5, sketch_dimension=3, seed=9), prompt)[0]
    expected = leverage_reference(keys, kvpress_sketch(9, 2, 2, 4, 3))
    torch.testing.assert_close(scores.double(), expected, atol=1e-4, rtol=1e-4)


def test_the_sketch_is_what_the_global_generator_draws_after_the_seed():
    torch.manual_seed(11)
    draws = [torch.randn(1, 2, 4, 3, dtype=torch.float32) for _ in range(3)]
    assert torch.equal(gaussian_sketch(11, 2, (1, 2, 4, 3), torch.float32), draws[2])


# CurDKV.


@pytest.mark.parametrize("leverage_type", ["key", "value", "kv_avg", "kv_product"])
def test_cur_scores_local_shares_of_the_squared_norms(leverage_type):
    """Windows of 4 over 10 tokens (the last of 2): each squared norm divided by its window's sum, combined as
    ``leverage_type`` says, divided by the total; the 2 sinks score 1."""
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(2, 10, 3, generator=gen), torch.randn(2, 10, 3, generator=gen)
    policy = make_policy("cur", 0.5, num_sinks=2, local_window_size=4, leverage_type=leverage_type)
    scores = scores_of(policy, prompt_of(keys, values))[0]
    for head in range(2):
        shares = []
        for states in (keys[head], values[head]):
            squared = (states.double() ** 2).sum(-1)
            shares.append(torch.cat([squared[s : s + 4] / squared[s : s + 4].sum() for s in (0, 4, 8)]))
        combined = {"key": shares[0], "value": shares[1], "kv_avg": (shares[0] + shares[1]) / 2,
                    "kv_product": shares[0] * shares[1]}[leverage_type]  # fmt: skip
        expected = combined / combined.sum()
        expected[:2] = 1.0
        torch.testing.assert_close(scores[head].double(), expected)


def test_cur_projects_by_the_layers_draw_of_the_seeded_generator():
    """With ``use_random_leverage``, layer 1 projects keys and values by the second draw of randn(D, 20) after
    torch.manual_seed(seed) (kvpress's global generator, drawn once per layer), over sqrt(20)."""
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 6, 3, generator=gen), torch.randn(1, 6, 3, generator=gen)
    prompt = prompt_of(keys, values)
    prompt.layer = 1
    policy = make_policy("cur", 0.5, num_sinks=0, use_random_leverage=True, use_local_approximation=False, seed=7)
    torch.manual_seed(7)
    torch.randn(3, 20)
    projection = torch.randn(3, 20) / math.sqrt(20)
    product = ((keys[0] @ projection) ** 2).sum(-1) * ((values[0] @ projection) ** 2).sum(-1)
    torch.testing.assert_close(scores_of(policy, prompt)[0, 0], product / product.sum())


# Non-causal chunked attention.


def non_causal_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int) -> torch.Tensor:
    """[Hkv, m] z-normalised non-causal chunk attention: per chunk of ``chunk`` tokens (the last completed with zero
    queries and keys, as kvpress pads it), softmax(q k^T) unscaled, summed over the chunk's queries, averaged over
    the group, times ||v||, averaged over each token and its two neighbours (zeros beyond the ends)."""
    heads, m, dim = query.shape
    group = heads // key.shape[0]
    keys = key.repeat_interleave(group, 0).double()
    sums = torch.zeros(heads, m, dtype=torch.float64)
    for start in range(0, m, chunk):
        size = min(chunk, m - start)
        q, k = torch.zeros(heads, chunk, dim, dtype=torch.float64), torch.zeros(heads, chunk, dim, dtype=torch.float64)
        q[:, :size], k[:, :size] = query[:, start : start + size].double(), keys[:, start : start + size]
        sums[:, start : start + size] = torch.softmax(q @ k.transpose(1, 2), -1).sum(1)[:, :size]
    scores = sums.view(key.shape[0], group, m).mean(1) * value.double().norm(dim=-1)
    padded = torch.nn.functional.pad(scores, (1, 1))
    pooled = (padded[:, :-2] + padded[:, 1:-1] + padded[:, 2:]) / 3
    return (pooled - pooled.mean()) / pooled.std()


def test_non_causal_attention_pads_its_last_chunk_with_zero_queries_that_attend_uniformly():
    """One head, a 2-token chunk completed to 4 with zero queries and keys: query (0, 2) on keys (1, 0), (0, 1)
    and the two zero keys gives softmax(0, 2, 0, 0); query (0, 0) and the two zero queries give each key 1/4."""
    from h2o_eval.policies.non_causal_attention import chunked_column_sums

    query = torch.tensor([[[0.0, 2.0], [0.0, 0.0]]])
    key = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    first = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 0.0]), 0)
    expected = first[:2] + 0.25 + 0.5
    torch.testing.assert_close(chunked_column_sums(query, key, 4)[0], expected)


def test_non_causal_attention_scores_by_its_definition():
    gen = torch.Generator().manual_seed(4)
    query, key, value = (torch.randn(h, 11, 4, generator=gen) for h in (4, 2, 2))
    scores = scores_of(make_policy("non_causal_attention", 0.5, chunk_size=4), prompt_of(key, value, query))[0]
    torch.testing.assert_close(scores.double(), non_causal_reference(query, key, value, 4), atol=1e-5, rtol=1e-5)


# Compactor, and AdaKV over it.


def compactor_reference(model, seen, layer: int, ratio: float) -> torch.Tensor:
    """[Hkv, T] Compactor's scores of one layer of the tiny Llama: tokens 2..T-3 score (1 - budget) x the
    leverage of their pre-rotary keys (``k_proj`` of the attention input) + their non-causal attention; the two
    first and two last tokens score the largest of those."""
    module = model.model.layers[layer].self_attn
    kv_heads, dim = seen["keys"].shape[0], seen["keys"].shape[-1]
    middle = slice(2, LENGTH - 2)
    with torch.no_grad():
        prerope = module.k_proj(seen["hidden"][middle]).view(-1, kv_heads, dim).transpose(0, 1)
    leverage = leverage_reference(prerope, kvpress_sketch(42, layer, kv_heads, dim, 8))
    attention = non_causal_reference(seen["query"][:, middle], seen["keys"][:, middle], seen["values"][:, middle], 8)
    blended = ratio * leverage + attention
    scores = torch.full((kv_heads, LENGTH), float(blended.max()), dtype=torch.float64)
    scores[:, middle] = blended
    return scores


def test_compactor_keeps_what_its_definition_keeps(tiny, observed):
    model, _ = tiny
    ids, layers = observed
    policy = make_policy("compactor", 0.5, **POLICIES["compactor"].example)
    kept = compressed(model, policy, ids)
    for layer, seen in enumerate(layers):
        scores = compactor_reference(model, seen, layer, 0.5)
        for head in range(scores.shape[0]):
            assert kept[layer][head] == top(scores[head], 20, {0, 1, 38, 39}), (layer, head)


def test_adakv_over_compactor_keeps_what_kvpress_adakv_keeps(tiny, observed):
    """Reference: kvpress's AdaKVPress over Compactor's scores (its definition above): each head's
    int(0.2 * 20) = 4 best are safe (the ends, scoring the largest, are among them), then the 2 * 20 best of the
    layer go to whichever head holds them."""
    model, _ = tiny
    ids, layers = observed
    policy = make_policy("adakv", 0.5, base="compactor", **POLICIES["compactor"].example)
    kept = compressed(model, policy, ids)
    for layer, seen in enumerate(layers):
        scores = compactor_reference(model, seen, layer, 0.5)
        safe = scores.topk(4, dim=-1).indices
        scores.scatter_(-1, safe, torch.inf)
        best = scores.flatten().topk(2 * 20).indices
        expected = [{int(i) % LENGTH for i in best if int(i) // LENGTH == head} for head in range(scores.shape[0])]
        assert kept[layer] == expected, layer


# ChunkKV over kvpress's SnapKV.


def snapkv_reference(seen, window: int, kernel: int, group: int) -> torch.Tensor:
    """[Hkv, T] kvpress's SnapKV scores: the last ``window`` rows' attention weights on the tokens before them,
    averaged over the rows, average-pooled (``kernel``, zero padding counted), averaged over the group; the window
    scores the largest + 1."""
    weights = seen["weights"][:, -window:, :-window].double().mean(1)
    pooled = torch.nn.functional.avg_pool1d(weights.unsqueeze(0), kernel, stride=1, padding=kernel // 2)[0]
    scores = pooled.view(-1, group, LENGTH - window).mean(1)
    return torch.cat([scores, torch.full((scores.shape[0], window), float(scores.max()) + 1)], -1)


def test_chunkkv_keeps_the_best_whole_chunks_of_its_base(tiny, observed):
    """40 tokens in 6 chunks of 7 (the last of 5, inside the window of 6 and kept): the 3 (int(6 * 0.5)) chunks of
    largest mean of the SnapKV scores summed over the KV heads, the same tokens in every head: C = 2 * 7 + 5."""
    model, _ = tiny
    ids, layers = observed
    policy = make_policy("chunkkv", 0.5, rounding="down", chunk_length=7, window=6, kernel_size=3, pooling="avg")
    kept = compressed(model, policy, ids)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, seen in enumerate(layers):
        summed = snapkv_reference(seen, 6, 3, group).sum(0)
        means = torch.stack([summed[start : start + 7].mean() for start in range(0, LENGTH, 7)])
        chunks = means.topk(3).indices.tolist()
        assert 5 in chunks
        expected = {j for c in chunks for j in range(7 * c, min(7 * c + 7, LENGTH))}
        assert len(expected) == 19 and kept[layer] == [expected] * len(kept[layer]), layer


def test_chunkkv_chooses_the_newest_of_tied_chunks_and_always_a_protected_shorter_last_one():
    """Chunks of 4 at budget 0.5: of 4 full chunks (16 tokens) the best 2, the newest of the tied; of 14 tokens (the
    last chunk of 2, inside the window of 4) the last chunk and the best 1 other, whatever the last one scores."""
    policy = make_policy("chunkkv", 0.5, chunk_length=4, window=4)
    assert policy.chosen(torch.tensor([3.0, 1.0, 3.0, 3.0]), 16).tolist() == [False, False, True, True]
    assert policy.chosen(torch.tensor([5.0, 5.0, 1.0, 0.0]), 14).tolist() == [False, True, False, True]
    assert policy.capacity(14) == 4 + 2


# Entropy-gated ChunkKV.


def test_entropy_gated_selection_keeps_spiky_chunks_best_tokens_and_tops_up():
    """Chunks of 4: A = 1.2 x4 (mean 1.2, uniform), B = 3, .6, .3, .1 (mean 1, spiky), C = .6, .5, .4, .3 (mean
    .45). A and B have at least the median mean, B alone is below the median entropy (C's): A whole, B's best 2,
    then C whole, and the 11th token is the best one left (B's .3)."""
    scores = torch.tensor([1.2] * 4 + [3.0, 0.6, 0.3, 0.1] + [0.6, 0.5, 0.4, 0.3])
    assert gated_selection(scores, 4, 2, 6).nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert gated_selection(scores, 4, 2, 9).nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert gated_selection(scores, 4, 2, 11).nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]


def test_entropy_gated_chunkkv_keeps_the_selection_of_its_bases_scores(tiny, observed):
    """Reference: kvpress's SnapKV scores (above) summed over the KV heads, through the gated selection of
    C = 20 tokens in chunks of 5 (spiky chunks keeping 2): every head keeps those 20."""
    model, _ = tiny
    ids, layers = observed
    policy = make_policy("entropy_gated_chunkkv", 0.5, chunk_length=5, low_entropy_chunk_length=2, window=6,
                         kernel_size=3, pooling="avg")  # fmt: skip
    kept = compressed(model, policy, ids)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, seen in enumerate(layers):
        selected = gated_selection(snapkv_reference(seen, 6, 3, group).sum(0).float(), 5, 2, 20)
        assert kept[layer] == [set(selected.nonzero().flatten().tolist())] * len(kept[layer]), layer


# FINCH.


@pytest.mark.parametrize(("normalize", "voted"), [(True, 17 / 24), (False, 7 / 24)])
def test_finch_weights_each_window_query_by_its_token_index(normalize, voted):
    """Four tokens, a window of 2, queries of zeros: token 2 attends 1/3 to each of tokens 0-2 and token 3 1/4 to
    each of tokens 0-3; weighted by their indices 2 and 3, tokens 0 and 1 score (2/3 + 3/4) / 2, else (1/3 + 1/4)
    / 2; the window scores nothing of its own (it is kept)."""
    prompt = prompt_of(torch.randn(1, 4, 2, generator=torch.Generator().manual_seed(6)), query=torch.zeros(1, 4, 2))
    scores = scores_of(make_policy("finch", 0.5, window=2, normalize_scores=normalize), prompt)
    torch.testing.assert_close(scores[0, 0], torch.tensor([voted, voted, 0.0, 0.0]))


@pytest.mark.parametrize("normalize", [True, False])
def test_finch_keeps_its_window_and_the_best_position_weighted_votes(tiny, observed, normalize):
    """Reference: the eager attention weights of the last 5 rows on the 35 tokens before them, row i times its
    index i (``normalize_scores``), averaged over the rows and the KV head's query heads; the window and the best
    15 others are kept."""
    model, _ = tiny
    ids, layers = observed
    kept = compressed(model, make_policy("finch", 0.5, window=5, normalize_scores=normalize), ids)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, seen in enumerate(layers):
        weights = seen["weights"][:, -5:, :-5].double()
        if normalize:
            weights = weights * torch.arange(35, 40).view(1, -1, 1)
        scores = weights.mean(1).view(-1, group, 35).mean(1)
        for head in range(scores.shape[0]):
            assert kept[layer][head] == top(scores[head], 15, set()) | set(range(35, 40)), (layer, head)
