"""The scorers that need more than attention votes (Expected Attention, KeyDiff, CriticalKV, KVzip, the oracle):
each by hand on tiny tensors, and each on a tiny Llama against an independent implementation of its definition
written here from the paper (not by calling the policy). kvpress itself is compared on SmolLM2 outside the suite
(see docs/policies.md, "Against kvpress")."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from h2o_eval import EvictionCache, load_model, make_policy
from h2o_eval.errors import ConfigError
from h2o_eval.generation import feed, settle
from h2o_eval.policies.inputs import Prompt, Rehearsal, Script
from h2o_eval.policies.kvzip import template_parts


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", device="cpu")


def prompt_of(key, value=None, query=None, real=None, capacity=2) -> Prompt:
    """A one-sequence prompt of keys [Hkv, n, D] (values and queries default to the keys; no rotary embedding)."""
    key = torch.as_tensor(key, dtype=torch.float32).unsqueeze(0)
    n = key.shape[2]
    value = key if value is None else torch.as_tensor(value, dtype=torch.float32).unsqueeze(0)
    query = key if query is None else torch.as_tensor(query, dtype=torch.float32).unsqueeze(0)
    return Prompt(
        module=torch.nn.Module(),
        layer=0,
        query=query,
        key=key,
        value=value,
        position=torch.arange(n).view(1, n),
        real=torch.ones(1, n, dtype=torch.bool) if real is None else torch.tensor([real]),
        capacity=torch.full((1, key.shape[1]), capacity),
        hidden_states=None,
        rotary=None,
        scaling=key.shape[-1] ** -0.5,
    )


def hand_prompt(keys, values=None, queries=None, capacity=2, real=None) -> Prompt:
    """A one-sequence, one-KV-head prompt of the given 2-d keys (no rotary embedding)."""
    query = None if queries is None else torch.tensor(queries, dtype=torch.float32).view(-1, len(keys), 2)
    return prompt_of([keys], None if values is None else [values], query, real, capacity)


def test_keydiff_by_hand():
    """Unit keys (1, 0), (0, 1), (1, 0), (-1, 0): their mean is (0.25, 0.25); cosine similarities 1/sqrt2, 1/sqrt2,
    1/sqrt2, -1/sqrt2, so the opposite key scores highest and the rest tie."""
    prompt = hand_prompt([[1, 0], [0, 2], [3, 0], [-1, 0]])
    scores = make_policy("keydiff", 2).compression_scores(
        prompt, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4, dtype=bool)
    )
    half = 1 / math.sqrt(2)
    torch.testing.assert_close(scores, torch.tensor([[[-half, -half, -half, half]]]))


def test_expected_attention_by_hand():
    """No rotary embedding, no sinks, no covariance: the expected logit of a key is its dot product with the mean
    query / sqrt(2). Queries (1, 0) and (3, 0) average to (2, 0); keys (1, 0), (0, 1), (-1, 0) get logits 2, 0, -2
    over sqrt(2), a softmax over them (0.78, 0.19, 0.05), each times its value's norm (1, 5, 1)."""
    prompt = hand_prompt([[1, 0], [0, 1], [-1, 0]], values=[[1, 0], [0, 5], [1, 0]], queries=[[1, 0], [3, 0], [2, 0]])
    policy = make_policy("expected_attention", 2, n_sink=0, use_covariance=False)
    scores = policy.compression_scores(prompt, torch.zeros(1, 1, 3), torch.zeros(1, 1, 3, dtype=bool))
    logits = torch.tensor([2.0, 0.0, -2.0]) / math.sqrt(2)
    expected = torch.softmax(logits, 0) * torch.tensor([1.0, 5.0, 1.0])
    torch.testing.assert_close(scores, expected.view(1, 1, 3))
    assert scores.argsort(descending=True).flatten().tolist() == [1, 0, 2]  # the large value outweighs the logit


def test_expected_attention_leaves_the_sinks_and_padding_out_of_its_statistics():
    """With n_sink = 1 the first real token (after a padding column) neither counts in the mean query nor gets a
    score; the softmax runs over the other real tokens."""
    prompt = hand_prompt([[0, 0], [5, 0], [1, 0], [-1, 0]], queries=[[0, 0], [9, 9], [1, 0], [3, 0]],
                         real=[False, True, True, True])  # fmt: skip
    scores = make_policy("expected_attention", 2, n_sink=1, use_covariance=False, use_vnorm=False).compression_scores(
        prompt, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4, dtype=bool)
    )
    logits = torch.tensor([2.0, -2.0]) / math.sqrt(2)  # mean query (2, 0) over tokens 2, 3
    torch.testing.assert_close(scores[0, 0], torch.cat([torch.zeros(2), torch.softmax(logits, 0)]))


@pytest.mark.parametrize(
    ("theta", "dim", "start"), [(10_000.0, 64, 4096), (10_000.0, 128, 3), (1_000_000.0, 256, 1000), (10_000.0, 8, 3)]
)
def test_the_average_rotation_is_kvpress_s_mean_of_rotary_matrices(theta, dim, start):
    """Reference: kvpress's ``apply_avg_rope`` written out, the m rotary matrices diag(cos_t) + P diag(sin_t) made
    and averaged; implementation: ``average_rotation`` from the mean cos and sin. At the real models' head sizes
    (SmolLM2 64, Llama 128, Gemma 3 256) the same numbers bit for bit, so kvpress keeps the same tokens; below 32
    torch sums the means in another order (a tiny model's 8: within float32 rounding)."""
    from h2o_eval.policies.expected_attention import average_rotation

    frequencies = torch.outer(torch.arange(start, start + 512).float(), theta ** -(torch.arange(0, dim, 2) / dim))
    cos, sin = torch.cat([frequencies] * 2, -1).cos(), torch.cat([frequencies] * 2, -1).sin()
    half = dim // 2
    swap = torch.zeros(dim, dim)
    swap[half:, :half], swap[:half, half:] = torch.eye(half), -torch.eye(half)
    expected = (cos.unsqueeze(1) * torch.eye(dim) + sin.unsqueeze(1) * swap).mean(dim=0)
    if dim >= 32:
        assert torch.equal(average_rotation(cos, sin), expected)
    torch.testing.assert_close(average_rotation(cos, sin), expected, rtol=0, atol=1e-7)


def test_criticalkv_two_stages_by_hand():
    """Base scores 4, 3, 2, 1 and projected value norms 1, 1, 10, 1 at C = 2, first stage 0.5: stage 1 keeps the
    best base score (token 0); stage 2 ranks the rest by (score + eps) * norm, so token 2 (20) beats token 1 (3)."""

    class Projection(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o_proj = torch.nn.Linear(2, 1, bias=False)
            self.o_proj.weight.data = torch.tensor([[1.0, 0.0]])

    prompt = hand_prompt([[1, 0], [1, 0], [1, 0], [1, 0]], values=[[1, 0], [1, 0], [10, 0], [1, 0]])
    prompt.module = Projection()
    policy = make_policy("criticalkv", 0.5, base="keydiff", epsilon=0.0)
    base = torch.tensor([[[4.0, 3.0, 2.0, 1.0]]])
    found = policy.base.compression_scores
    policy.base.__class__.compression_scores = lambda self, prompt, scores, protected: base
    try:
        scores = policy.compression_scores(prompt, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4, dtype=bool))
    finally:
        policy.base.__class__.compression_scores = found
    assert scores[0, 0, 0] == torch.finfo(torch.float32).max
    assert scores[0, 0, 1:].tolist() == [3.0, 20.0, 1.0]


def hand_rehearsal(logits_rows, held, position, index=0, real=None, script=None) -> Rehearsal:
    """One sequence, one KV head, head dim 1: a query of 1 against keys whose values are the given logits."""
    rows = torch.tensor(logits_rows, dtype=torch.float32)  # [m, S + m] logits
    m, total = rows.shape
    return Rehearsal(
        index=index,
        script=script,
        module=torch.nn.Module(),
        layer=0,
        query=torch.ones(1, 1, m, 1),
        key=rows[:1].view(1, 1, total, 1),
        value=torch.zeros(1, 1, total, 1),
        held=torch.tensor([[held]]),
        position=torch.tensor([[position]]),
        real=torch.ones(1, m, dtype=torch.bool) if real is None else torch.tensor([real]),
        scaling=1.0,
    )


def test_oracle_sums_the_pass_attention_over_its_queries():
    """Two held slots with logits 0 and log 3, one pass token attending to them and to itself (logit 0): its
    probabilities 1/5, 3/5 (and 1/5 to itself) are the slots' scores; a second, padded query adds nothing."""
    rehearsal = hand_rehearsal([[0.0, math.log(3), 0.0, 0.0]], [True, True], [0, 1], real=[True, False])
    rehearsal.query = torch.ones(1, 1, 2, 1)
    rehearsal.key = torch.tensor([0.0, math.log(3), 0.0, 5.0]).view(1, 1, 4, 1)
    scores = make_policy("oracle", 1).rehearse(rehearsal, torch.zeros(1, 1, 2))
    torch.testing.assert_close(scores, torch.tensor([[[0.2, 0.6]]]))


def test_kvzip_allocates_the_lowest_scores_model_wide_or_per_layer():
    """Two layers, one KV head, 4 tokens each, budget 0.5, 1 sink: model-wide, int(8 * 0.5) = 4 of the 8 pairs go
    (the lowest scores: layer 0's 0.1 and 0.2, layer 1's 0.15 and 0.3), so each layer keeps 2; per layer, each
    keeps int(4 * 0.5) = 2 too, but a skewed table keeps 3 and 1 model-wide (0.1, 0.2, 0.3 and 0.7 go)."""
    held = [torch.ones(1, 1, 4, dtype=torch.bool)] * 2
    planned = [torch.tensor([[2]])] * 2
    even = [torch.tensor([[[0.0, 0.9, 0.1, 0.2]]]), torch.tensor([[[0.0, 0.15, 0.8, 0.3]]])]
    skewed = [torch.tensor([[[0.0, 0.9, 0.8, 0.7]]]), torch.tensor([[[0.0, 0.1, 0.2, 0.3]]])]
    model_wide = make_policy("kvzip", 0.5, n_sink=1)
    per_layer = make_policy("kvzip", 0.5, n_sink=1, layerwise=True)
    assert [int(c.sum()) for c in model_wide.allocate(even, held, planned)] == [2, 2]
    assert [int(c.sum()) for c in model_wide.allocate(skewed, held, planned)] == [3, 1]
    assert [int(c.sum()) for c in per_layer.allocate(skewed, held, planned)] == [2, 2]


def random_rehearsal(gen, held, m, group, dim, real) -> Rehearsal:
    """A pass of ``m`` tokens over the slots ``held`` [B, Hkv, S] (positions 0..S-1), ``group`` query heads per KV
    head: random queries, keys (larger, so that softmaxes are peaked) and values."""
    batch, kv_heads, slots = held.shape
    return Rehearsal(
        index=0,
        script=None,
        module=torch.nn.Module(),
        layer=0,
        query=torch.randn(batch, kv_heads * group, m, dim, generator=gen),
        key=torch.randn(batch, kv_heads, slots + m, dim, generator=gen) * 2,
        value=torch.randn(batch, kv_heads, slots + m, dim, generator=gen),
        held=held,
        position=torch.arange(slots).expand(batch, kv_heads, slots),
        real=real,
        scaling=dim**-0.5,
    )


@pytest.mark.parametrize(("plus", "block"), [(False, 1), (False, 4), (False, 256), (True, 1), (True, 4)])
def test_kvzip_scores_by_blocks_of_queries_what_the_pass_probabilities_give(monkeypatch, plus, block):
    """Reference: Rehearsal.probabilities over every query at once (softmax over the visible slots and the pass's
    tokens up to each query; KVzip+: each query's row divided by its input's norm, each slot's column multiplied
    by ||v W_O|| of the query head), the largest per slot over the group and the real queries. Implementation:
    KVzip's scorer, which reads only the visible slots, ``block`` queries at a time; two sequences, 2 KV heads of
    3 query heads each, KV heads holding different slots, the second pass padded at its end."""
    from h2o_eval.policies import kvzip
    from h2o_eval.policies.inputs import output_projection

    monkeypatch.setattr(kvzip, "BLOCK", block)
    gen = torch.Generator().manual_seed(11)
    slots, m, kv_heads, group, dim, hidden = 40, 9, 2, 3, 8, 16
    module = torch.nn.Module()
    module.o_proj = torch.nn.Linear(kv_heads * group * dim, hidden, bias=False)
    torch.nn.init.normal_(module.o_proj.weight, generator=gen)
    held = torch.rand(2, kv_heads, slots, generator=gen) > 0.2
    rehearsal = random_rehearsal(gen, held, m, group, dim, torch.tensor([[True] * m, [True] * 6 + [False] * 3]))
    rehearsal.module = module
    rehearsal.hidden_states = torch.randn(2, m, hidden, generator=gen) * torch.linspace(0.5, 3, m).view(1, m, 1)
    visible = held & (torch.rand(2, kv_heads, slots, generator=gen) > 0.4)
    projection = output_projection(module, kv_heads * group, dim).detach().view(kv_heads, group, dim, hidden)
    for row in range(2):
        columns = torch.cat([visible[row], rehearsal.real[row].expand(kv_heads, -1)], dim=-1)
        expected = rehearsal.probabilities(columns.expand(2, -1, -1))[row, ..., :slots]  # [Hkv, G, m, S]
        if plus:
            written = torch.einsum("hgdj,hsd->hgsj", projection, rehearsal.value[row, :, :slots]).norm(dim=-1)
            inputs = rehearsal.hidden_states[row].norm(dim=-1).clamp(min=1e-9)  # pad rows' probabilities are 0
            expected = expected / inputs.view(1, 1, m, 1) * written.unsqueeze(2)
        expected = expected.amax(dim=(1, 2))
        with torch.no_grad():
            found = kvzip._best(rehearsal, row, visible[row], plus=plus)
        torch.testing.assert_close(found, expected.masked_fill(~visible[row], 0.0))
        assert bool((found[visible[row]] > 0).all())


def test_a_split_pass_attention_is_the_models_attention_and_gives_the_normaliser_of_its_columns():
    """Reference: each query's softmax over the held slots and the pass's tokens up to itself, written out (the
    attention SDPA computes for the pass), and the log-sum-exp of its logits over the chosen slots and those
    tokens. Implementation: three fused attentions combined (:meth:`Rehearsal.split_attention`); two sequences,
    the first left-padded (slots not held), 2 KV heads of 3 query heads each."""
    gen = torch.Generator().manual_seed(5)
    slots, m, kv_heads, group, dim = 30, 7, 2, 3, 8
    held = torch.ones(2, kv_heads, slots, dtype=torch.bool)
    held[0, :, :6] = False
    rehearsal = random_rehearsal(gen, held, m, group, dim, torch.ones(2, m, dtype=torch.bool))
    assert rehearsal.splits()
    causal = torch.ones(m, m, dtype=torch.bool).tril()
    for row, chosen in ((0, [6, 7, 20, 21, 22]), (1, [0, 1, 2, 3])):
        columns = torch.tensor(chosen)
        key = rehearsal.key[row].repeat_interleave(group, 0)  # [Hq, S + m, D]
        logits = rehearsal.query[row] @ key.transpose(-1, -2) * rehearsal.scaling  # [Hq, m, S + m]
        seen = torch.cat([held[row, 0].expand(m, -1), causal], -1)
        expected = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1) @ rehearsal.value[row].repeat_interleave(
            group, 0
        )
        subset = torch.zeros(slots + m, dtype=torch.bool)
        subset[columns] = True
        normaliser = logits.masked_fill(~(seen & torch.cat([subset[:slots].expand(m, -1), causal], -1)), float("-inf"))
        output, found = rehearsal.split_attention(row, columns)
        torch.testing.assert_close(output, expected)
        torch.testing.assert_close(found, normaliser.logsumexp(-1))


@pytest.mark.parametrize("plus", [False, True])
@torch.no_grad()
def test_kvzip_keeps_the_same_whether_its_pass_attention_splits_or_not(tiny, monkeypatch, plus):
    """The same context compressed twice by KVzip: once with the pass's attention split, scored by the normaliser
    it gives (the CPU's path), once by the model's attention and softmaxes of the scored columns (any other
    device's): the same scores in every layer, the same tokens kept."""
    model, tokenizer = tiny
    prefix, _ = template_parts(tokenizer)
    ids = torch.randint(100, 4000, (1, prefix + 30), generator=torch.Generator().manual_seed(8))
    policy = make_policy("kvzip", 0.5, n_sink=2, chunk_size=16, kvzip_plus_normalization=plus)
    seen = []
    monkeypatch.setattr(policy.__class__, "allocate", lambda self, scores, *rest, f=policy.allocate.__func__: (
        seen.append([s.clone() for s in scores]), f(self, scores, *rest))[1])  # fmt: skip
    split = compress_context(model, tokenizer, policy, ids)
    monkeypatch.setattr(Rehearsal, "splits", lambda self: False)
    plain = compress_context(model, tokenizer, policy, ids)
    ours, theirs = seen
    for layer in range(len(ours)):
        torch.testing.assert_close(ours[layer], theirs[layer])
    assert kept_by_layer(split) == kept_by_layer(plain)


def test_kvzip_repeats_each_chunk_after_the_template_prefix(tiny):
    """The passes: "Repeat the previous context exactly." + the template's end of turn + the first chunk; later
    chunks open with the "part ... starting with" request and the previous chunk's last 8 tokens."""
    _, tokenizer = tiny
    prefix, suffix = template_parts(tokenizer)
    context = list(range(1000, 1000 + prefix + 20))
    passes = make_policy("kvzip", 0.5, chunk_size=12).passes(Script([context], [[]], None, tokenizer))
    first = tokenizer.encode("\n\nRepeat the previous context exactly.", add_special_tokens=False)
    later = tokenizer.encode(
        "\n\nRepeat the part of the previous context exactly, starting with", add_special_tokens=False
    )
    body = context[prefix:]
    assert passes == [[first + list(suffix) + body[:12]], [later + body[4:12] + list(suffix) + body[12:]]]


# Independent implementations on the tiny Llama, from each method's definition.


def attention_inputs(model, ids):
    """Per layer the attention module's input and the cache's keys and values after a plain forward."""
    captured = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: captured.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True
        )
        for i, layer in enumerate(model.model.layers)
    ]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    return [(captured[i], cache.layers[i].keys, cache.layers[i].values) for i in range(len(model.model.layers))]


def rotation(theta: float, dim: int, positions: torch.Tensor) -> torch.Tensor:
    """[D, D] the mean rotary matrix over ``positions``: each pair (i, i + D/2) rotated by position * theta^(-2i/D)
    (the rotate-half convention)."""
    half = dim // 2
    frequencies = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)
    total = torch.zeros(dim, dim, dtype=torch.float64)
    for position in positions.tolist():
        angle = position * frequencies
        matrix = torch.zeros(dim, dim, dtype=torch.float64)
        idx = torch.arange(half)
        matrix[idx, idx] = matrix[idx + half, idx + half] = torch.cos(angle)
        matrix[idx, idx + half] = -torch.sin(angle)
        matrix[idx + half, idx] = torch.sin(angle)
        total += matrix
    return (total / len(positions)).float()


def kept_by_layer(cache) -> list[list[set[int]]]:
    return [
        [set(layer.position[0, h][layer.held[0, h]].tolist()) for h in range(layer.held.shape[1])]
        for layer in cache.layers
    ]


def compress_context(model, tokenizer, policy, ids):
    cache = EvictionCache(model, policy, protocol="context")
    mask = torch.ones_like(ids)
    feed(model, cache, ids, mask)
    settle(model, cache, tokenizer, ids, mask, [[]], max_new_tokens=4, do_sample=False, pad_token_id=0)
    return cache


def top(scores: torch.Tensor, count: int, always: set[int]) -> set[int]:
    """``always`` plus the ``count`` - len(always) best other positions (ties: the newest)."""
    order = sorted((j for j in range(scores.shape[-1]) if j not in always), key=lambda j: (-float(scores[j]), -j))
    return always | set(order[: count - len(always)])


@torch.no_grad()
def test_expected_attention_keeps_what_its_definition_keeps(tiny):
    """Reference: the paper's expected attention from the model's own pre-rotary queries (``q_proj`` of each
    attention module's input), their mean and covariance over the tokens after the sinks, the rotary matrix
    averaged over the next 32 positions built from the RoPE frequencies, and a softmax of the expected logits
    over the keys after the sinks, averaged over the KV head's query heads and times the value norms."""
    model, tokenizer = tiny
    ids = torch.randint(100, 4000, (1, 40), generator=torch.Generator().manual_seed(3))
    policy = make_policy("expected_attention", 0.25, n_future_positions=32, n_sink=2)
    cache = compress_context(model, tokenizer, policy, ids)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    for layer, (hidden, keys, values) in enumerate(attention_inputs(model, ids)):
        module = model.model.layers[layer].self_attn
        query = module.q_proj(hidden[0]).view(40, heads, dim).transpose(0, 1)[:, 2:].double()  # [H, 38, D]
        mean = query.mean(1)
        centered = query - mean.unsqueeze(1)
        covariance = centered.transpose(1, 2) @ centered / 38
        rotate = rotation(config.rope_parameters["rope_theta"], dim, torch.arange(40, 72)).double()
        mean, covariance = mean @ rotate.T, rotate @ covariance @ rotate.T
        for h in range(kv_heads):
            expected = torch.zeros(38, dtype=torch.float64)
            for g in range(heads // kv_heads):
                q = h * (heads // kv_heads) + g
                key = keys[0, h, 2:].double()
                logit = key @ mean[q] / math.sqrt(dim) + ((key @ covariance[q]) * key).sum(-1) / dim / 2
                expected += torch.softmax(logit, 0) / (heads // kv_heads)
            expected *= values[0, h, 2:].double().norm(dim=-1)
            full = torch.cat([torch.full((2,), float("inf"), dtype=torch.float64), expected])
            assert kept_by_layer(cache)[layer][h] == top(full, 10, {0, 1}), (layer, h)


@torch.no_grad()
def test_keydiff_keeps_what_its_definition_keeps(tiny):
    model, tokenizer = tiny
    ids = torch.randint(100, 4000, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = compress_context(model, tokenizer, make_policy("keydiff", 0.3), ids)
    for layer, (_, keys, _) in enumerate(attention_inputs(model, ids)):
        for h in range(keys.shape[1]):
            key = keys[0, h].double()
            anchor = (key / key.norm(dim=-1, keepdim=True)).mean(0)
            score = -(key @ anchor) / (key.norm(dim=-1) * anchor.norm())
            assert kept_by_layer(cache)[layer][h] == top(score, 12, set()), (layer, h)


@torch.no_grad()
def test_criticalkv_keeps_what_its_definition_keeps(tiny):
    """Reference: KeyDiff's scores (its definition above), the first int(C / 2) kept by them, the rest ranked by
    (score + 1e-4) * the L1 norm of each value times its query heads' rows of the output projection, averaged."""
    model, tokenizer = tiny
    ids = torch.randint(100, 4000, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = compress_context(model, tokenizer, make_policy("criticalkv", 0.3, base="keydiff"), ids)
    heads = model.config.num_attention_heads
    for layer, (_, keys, values) in enumerate(attention_inputs(model, ids)):
        weight = model.model.layers[layer].self_attn.o_proj.weight.double()  # [hidden, Hq * D]
        kv_heads, dim = keys.shape[1], keys.shape[-1]
        group = heads // kv_heads
        for h in range(kv_heads):
            key = keys[0, h].double()
            anchor = (key / key.norm(dim=-1, keepdim=True)).mean(0)
            base = -(key @ anchor) / (key.norm(dim=-1) * anchor.norm())
            first = top(base, 6, set())
            norms = (
                sum(
                    (values[0, h].double() @ weight[:, (h * group + g) * dim : (h * group + g + 1) * dim].T)
                    .abs()
                    .sum(-1)
                    for g in range(group)
                )
                / group
            )
            stage2 = (base + 1e-4) * norms
            stage2[list(first)] = float("inf")
            assert kept_by_layer(cache)[layer][h] == top(stage2, 12, set()), (layer, h)


@torch.no_grad()
def test_oracle_keeps_the_tokens_the_question_and_full_answer_attend_to(tiny):
    """Reference: the full cache's greedy answer (plain generate), then the unpatched model's own attention weights
    (eager) over context + question + that answer; each context token's score is the sum over the question's and
    answer's rows and over the KV head's query heads; the newest context token is kept, then the best."""
    model, tokenizer = tiny
    gen = torch.Generator().manual_seed(6)
    context, question = (
        torch.randint(100, 4000, (1, 30), generator=gen),
        torch.randint(100, 4000, (1, 5), generator=gen),
    )
    prompt = torch.cat([context, question], 1)
    answer = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)[:, 35:]
    cache = EvictionCache(model, make_policy("oracle", 0.3), protocol="context")
    feed(model, cache, context, torch.ones_like(context))
    settle(model, cache, tokenizer, context, torch.ones_like(context), question.tolist(), max_new_tokens=4,
           do_sample=False, pad_token_id=0)  # fmt: skip
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        attentions = model(torch.cat([prompt, answer], 1), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    for layer, weights in enumerate(attentions):
        kv_heads = cache.layers[layer].held.shape[1]
        group = weights.shape[1] // kv_heads
        for h in range(kv_heads):
            score = weights[0, h * group : (h + 1) * group, 30:, :30].sum(dim=(0, 1))
            assert kept_by_layer(cache)[layer][h] == top(score, 9, {29}), (layer, h)


@pytest.mark.parametrize(("plus", "block"), [(False, 256), (False, 5), (True, 5)])
@torch.no_grad()
def test_kvzip_keeps_what_its_definition_keeps(tiny, monkeypatch, plus, block):
    """Reference: the repeat passes fed after the context through a plain DynamicCache (cut back after each), each
    pass's post-rotary queries (the module's q_proj and the model's rotary embedding at the pass's positions)
    against the sinks, its chunk's context keys and its own keys, softmaxed there (KVzip+: each query's row
    divided by the norm of its attention input, each key's column multiplied by ||v W_O|| of the query head), the
    largest probability per context token over the pass's queries and the group; then the lowest of all layers'
    pairs go (sinks never). The implementation scores ``block`` queries at a time (here also several blocks)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from h2o_eval.policies import kvzip

    monkeypatch.setattr(kvzip, "BLOCK", block)
    model, tokenizer = tiny
    prefix, _ = template_parts(tokenizer)
    ids = torch.randint(100, 4000, (1, prefix + 30), generator=torch.Generator().manual_seed(7))
    policy = make_policy("kvzip", 0.5, n_sink=2, chunk_size=16, kvzip_plus_normalization=plus)
    cache = compress_context(model, tokenizer, policy, ids)
    passes = policy.passes(Script([ids[0].tolist()], [[]], None, tokenizer))
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    dim, group, length = model.config.hidden_size // heads, heads // kv_heads, ids.shape[1]
    scores = torch.zeros(len(model.model.layers), kv_heads, length)
    for index, [tokens] in enumerate(passes):
        start = prefix + 16 * index
        end = min(start + 16, length)
        extra = torch.tensor([tokens])
        m = extra.shape[1]
        inputs = attention_inputs(model, torch.cat([ids, extra], 1))
        positions = torch.arange(length, length + m).view(1, -1)
        cos, sin = model.model.rotary_emb(extra.float(), positions)
        for layer, (hidden, keys, values) in enumerate(inputs):
            module = model.model.layers[layer].self_attn
            query = module.q_proj(hidden[:, length:]).view(1, m, heads, dim).transpose(1, 2)
            query, _ = apply_rotary_pos_emb(query, query, cos, sin)
            columns = list(range(min(2, start))) + list(range(start, end)) + list(range(length, length + m))
            for h in range(kv_heads):
                logits = query[0, h * group : (h + 1) * group] @ keys[0, h, columns].T / math.sqrt(dim)
                causal = torch.ones(m, len(columns), dtype=torch.bool)
                causal[:, -m:] = torch.ones(m, m, dtype=torch.bool).tril()
                probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # [G, m, columns]
                if plus:
                    heads_of = range(h * group, (h + 1) * group)
                    written = torch.stack(
                        [(values[0, h, columns] @ module.o_proj.weight[:, q * dim : (q + 1) * dim].T).norm(dim=-1)
                         for q in heads_of]
                    )  # fmt: skip
                    probs = probs / hidden[0, length:].norm(dim=-1).view(1, m, 1) * written.unsqueeze(1)
                best = probs.amax(dim=(0, 1))
                chunk = len(range(min(2, start)))
                scores[layer, h, start:end] = best[chunk : chunk + end - start]
    scores[..., :2] = float("inf")
    gone = scores.flatten().argsort(stable=True)[: int(scores.numel() * 0.5)]
    keep = torch.ones(scores.numel(), dtype=torch.bool)
    keep[gone] = False
    keep = keep.view_as(scores)
    for layer in range(scores.shape[0]):
        for h in range(kv_heads):
            assert kept_by_layer(cache)[layer][h] == set(torch.nonzero(keep[layer, h]).flatten().tolist())


def test_extra_passes_cannot_run_in_a_single_forward(tiny, tmp_path, data_dir):
    from conftest import make_config

    from h2o_eval.run import validate

    model, _ = tiny
    with pytest.raises(ConfigError, match="scores its prompt by extra passes before compressing it"):
        EvictionCache(model, make_policy("kvzip", 0.5), protocol="prefill", one_forward=True)
    with pytest.raises(ConfigError, match="a log-likelihood request's single forward cannot run"):
        validate(make_config(data_dir, tmp_path, task="copa", policy="kvzip", protocol="prefill"))
