"""``decoding=interval`` (kvpress's DecodingPress): every ``steps`` forwards after the prompt the cache is compressed
to the target by the decoding policy's scores. Reference: a plain re-implementation over transformers' own
``DynamicCache``, fed token by token, its keys scored by hand every ``steps`` tokens (key norms; SnapKV's window
votes from the attention inputs a hook kept) and cut to the target, ties to the newest token."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import fast_sample
from transformers import DynamicCache

from h2o_eval import EvictionCache, load_model, make_policy
from h2o_eval.errors import ConfigError
from h2o_eval.policies import POLICIES, Interval, example_policy
from h2o_eval.policies.base import refuse_interval_policy

PROMPT, NEW, EVERY, TARGET = 24, 21, 4, 10


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", device="cpu")


def prompt_ids() -> torch.Tensor:
    return torch.randperm(400, generator=torch.Generator().manual_seed(5))[:PROMPT].view(1, -1) + 5


def knorm_scores(model, layer, keys, values, rows, now):
    return -keys.norm(dim=-1)


def keydiff_scores(model, layer, keys, values, rows, now):
    """KeyDiff as kvpress's DecodingPress scores the cache: minus each key's cosine to its head's mean unit key."""
    anchor = torch.nn.functional.normalize(keys, dim=-1).mean(dim=2, keepdim=True)
    return -torch.nn.functional.cosine_similarity(keys, anchor, dim=-1)


def cur_scores(model, layer, keys, values, rows, now, window=4, sinks=2):
    """CurDKV's kv_product leverage as kvpress's CURPress computes it on the cache it is handed: squared norms as
    shares of their windows of ``window`` held tokens from the oldest, their product as a share of its sum, the
    ``sinks`` oldest held tokens 1."""

    def shares(norms):
        length = norms.shape[-1]
        padded = torch.nn.functional.pad(norms, (0, (window - length % window) % window))
        padded = padded.view(*norms.shape[:-1], -1, window)
        return (padded / padded.sum(-1, keepdim=True)).flatten(-2)[..., :length]

    scores = shares((keys**2).sum(-1)) * shares((values**2).sum(-1))
    scores = scores / scores.sum(-1, keepdim=True)
    scores[..., :sinks] = 1.0
    return scores


def lagkv_scores(model, layer, keys, values, rows, now, sinks=2, lag=4):
    """LagKV as kvpress's LagKVPress scores the cache it is handed: after the ``sinks`` oldest, partitions of ``lag``
    held tokens, each token min-max normalised by the next partition's range, the std over channels softmaxed
    over its partition, key and value averaged and ranked; the sinks, the last partition and the remainder 1."""
    batch, heads, length, dim = keys.shape
    if length < sinks + 2 * lag:  # too short to partition: the sinks 1, the rest the newer the higher
        ramp = torch.ones(batch, heads, length)
        ramp[..., sinks:] = torch.arange(length - sinks) / (length - sinks)
        return ramp
    end = sinks + (length - sinks) // lag * lag

    def lagged(states):
        parts = states[:, :, sinks:end].reshape(batch, heads, -1, lag, dim)
        low, high = parts[:, :, 1:].amin(-2, keepdim=True), parts[:, :, 1:].amax(-2, keepdim=True)
        return ((parts[:, :, :-1] - low) / (high - low)).std(-1).softmax(-1)

    ranks = ((lagged(keys) + lagged(values)) / 2).argsort(-1).argsort(-1) / lag
    ones = torch.ones(batch, heads, sinks), torch.ones(batch, heads, length - end + lag)
    return torch.cat([ones[0], ranks.flatten(2).float(), ones[1]], dim=-1)


def expected_attention_scores(model, layer, keys, values, rows, now, sinks=2, future=16):
    """Expected Attention as kvpress's DecodingPress scores the cache with it: the mean and covariance of the
    buffered rows' queries before rotary (but the first ``sinks`` rows), rotated by the mean rotary matrix of the
    ``future`` positions from the buffer's length, over the held keys but the oldest ``sinks`` (which score
    highest), softmaxed, averaged over each KV head's queries, times the value norms."""
    attention = model.model.layers[layer].self_attn
    hidden = torch.cat(rows, dim=1)
    length, heads, dim, kv_heads = hidden.shape[1], model.config.num_attention_heads, attention.head_dim, keys.shape[1]
    query = attention.q_proj(hidden[:, sinks:]).view(1, length - sinks, heads, dim).transpose(1, 2)
    mean = query.mean(2)
    centered = query - mean.unsqueeze(2)
    covariance = centered.transpose(-1, -2) @ centered / (length - sinks)
    cos, sin = model.model.rotary_emb(query, torch.arange(length, length + future).view(1, -1))
    swap = torch.zeros(dim, dim)
    swap[dim // 2 :, : dim // 2], swap[: dim // 2, dim // 2 :] = torch.eye(dim // 2), -torch.eye(dim // 2)
    rotation = (cos[0].unsqueeze(1) * torch.eye(dim) + sin[0].unsqueeze(1) * swap).mean(0)
    mean, covariance = mean @ rotation.T, rotation @ covariance @ rotation.T
    key = keys[:, :, sinks:].repeat_interleave(heads // kv_heads, dim=1)
    logits = (key @ mean.unsqueeze(-1)).squeeze(-1) / dim**0.5
    logits = logits + ((key @ covariance) * key).sum(-1) / dim / 2
    expected = logits.softmax(-1).view(1, kv_heads, heads // kv_heads, -1).mean(2)
    expected = expected * values[:, :, sinks:].norm(dim=-1)
    return torch.cat([torch.full((1, kv_heads, sinks), float(expected.max()) + 1), expected], dim=-1)


def snapkv_scores(model, layer, keys, values, rows, now, window=2, kernel=3):
    """SnapKV's votes as kvpress's DecodingPress computes them: the last ``window`` attention inputs' queries, all at
    the newest position, over the keys up to their own, the window's columns then kept whatever their score."""
    attention = model.model.layers[layer].self_attn
    hidden = torch.cat(rows, dim=1)[:, -window:]
    heads, dim = model.config.num_attention_heads, attention.head_dim
    query = attention.q_proj(hidden).view(1, window, heads, dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(query, torch.tensor([[now]] * 1))
    query = query * cos.unsqueeze(1) + torch.cat((-query[..., dim // 2 :], query[..., : dim // 2]), -1) * sin.unsqueeze(
        1
    )
    repeated = keys.repeat_interleave(heads // keys.shape[1], dim=1)
    logits = query @ repeated.transpose(-1, -2) * attention.scaling
    length = keys.shape[2]
    logits = logits + torch.full_like(logits, -torch.inf).triu(length - window + 1)
    votes = logits.softmax(-1)[..., : length - window].sum(2)
    votes = votes.view(1, keys.shape[1], -1, length - window).sum(2)
    pooled = torch.nn.functional.avg_pool1d(votes, kernel, stride=1, padding=kernel // 2)
    return torch.cat([pooled, torch.full((1, keys.shape[1], window), torch.inf)], dim=-1)


def observed_attention_scores(model, layer, keys, values, rows, now):
    """kvpress's ObservedAttentionPress as its DecodingPress scores the cache: the compressing forward's attention
    row over the held keys (its query at the newest position), divided by n, n - 1, ..., 1 along the cache,
    averaged over each KV head's query heads."""
    attention = model.model.layers[layer].self_attn
    heads, dim, kv_heads, length = model.config.num_attention_heads, attention.head_dim, keys.shape[1], keys.shape[2]
    query = attention.q_proj(rows[-1]).view(1, 1, heads, dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(query, torch.tensor([[now]]))
    halves = torch.cat((-query[..., dim // 2 :], query[..., : dim // 2]), -1)
    query = query * cos.unsqueeze(1) + halves * sin.unsqueeze(1)
    weights = query @ keys.repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) * attention.scaling
    scores = weights.softmax(-1).sum(2) / torch.arange(length, 0, -1)
    return scores.view(1, kv_heads, -1, length).mean(2)


def criticalkv_scores(model, layer, keys, values, rows, now, base=keydiff_scores, mean=1, epsilon=1e-4):
    """CriticalKV as kvpress's DecodingPress scores the cache with it: its base's scores (``mean`` rows and query
    heads averaged), the top int(TARGET / 2) the highest, the rest (score + ``epsilon``) times the L1 norm of each value
    through the output projection, averaged over the KV head's query heads."""
    scores = base(model, layer, keys, values, rows, now) / mean
    top = scores.topk(TARGET // 2, dim=-1).indices
    attention = model.model.layers[layer].self_attn
    heads, dim, kv_heads = model.config.num_attention_heads, attention.head_dim, keys.shape[1]
    projection = attention.o_proj.weight.T.reshape(heads, dim, -1)
    projected = torch.einsum("bhtd,hdo->bhto", values.repeat_interleave(heads // kv_heads, dim=1), projection)
    norms = projected.abs().sum(-1).view(1, kv_heads, heads // kv_heads, -1).mean(2)
    return ((scores + epsilon) * norms).scatter(-1, top, torch.finfo(torch.float32).max)


def reference(model, ids, score):
    """Greedy tokens and logits of a full DynamicCache compressed by hand every EVERY decode tokens to TARGET."""
    rows: dict[int, list[torch.Tensor]] = {}

    def keep_input(module, args, kwargs):
        rows.setdefault(module.layer_idx, []).append(kwargs["hidden_states"])

    hooks = [layer.self_attn.register_forward_pre_hook(keep_input, with_kwargs=True) for layer in model.model.layers]
    try:
        cache = DynamicCache()
        logits = [model(ids, cache=cache).logits[0, -1]]
        rows.clear()
        for step in range(NEW - 1):
            token = logits[-1].argmax().view(1, 1)
            now = PROMPT + step
            logits.append(model(token, cache=cache, position_ids=torch.tensor([[now]])).logits[0, -1])
            if (step + 1) % EVERY == 0:
                for index, layer in enumerate(cache.layers):
                    scores = score(model, index, layer.keys, layer.values, rows[index], now)
                    order = scores.flip(-1).argsort(dim=-1, descending=True, stable=True)[..., :TARGET]
                    kept = (scores.shape[-1] - 1 - order).sort(-1).values.unsqueeze(-1).expand(-1, -1, -1, 16)
                    layer.keys, layer.values = layer.keys.gather(2, kept), layer.values.gather(2, kept)
                rows.clear()
    finally:
        for hook in hooks:
            hook.remove()
    logits = torch.stack(logits)
    return logits.argmax(-1), logits


def interval_run(model, ids, decoding_policy, graphs=False):
    interval = Interval(EVERY, target_size=TARGET, policy=decoding_policy)
    cache = EvictionCache(
        model, make_policy("full", 1.0), protocol="context", decoding="interval", interval=interval,
        graphs="emulate" if graphs else False,
    )  # fmt: skip
    logits = [model(ids, cache=cache, use_cache=True).logits[0, -1]]
    for step in range(NEW - 1):
        token = logits[-1].argmax().view(1, 1)
        position = torch.tensor([[PROMPT + step]])
        logits.append(model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits[0, -1])
    logits = torch.stack(logits)
    return logits.argmax(-1), logits, cache


@pytest.mark.parametrize(
    ("name", "params", "score"),
    [
        ("knorm", {}, knorm_scores),
        ("snapkv", {"window": 2, "kernel_size": 3, "pooling": "avg"}, snapkv_scores),
        ("keydiff", {}, keydiff_scores),
        ("cur", {"num_sinks": 2, "local_window_size": 4}, cur_scores),
        ("lagkv", {"n_sink": 2, "lag_size": 3}, functools.partial(lagkv_scores, lag=3)),
        ("lagkv", {"n_sink": 2, "lag_size": 7}, functools.partial(lagkv_scores, lag=7)),
        ("expected_attention", {"n_sink": 2, "n_future_positions": 16}, expected_attention_scores),
        ("observed_attention", {}, observed_attention_scores),
        ("criticalkv", {"base": "keydiff"}, criticalkv_scores),
        (
            "criticalkv",
            {"base": "snapkv", "window": 2, "kernel_size": 3, "pooling": "avg", "epsilon": 0.05},
            functools.partial(criticalkv_scores, base=snapkv_scores, mean=2 * 2, epsilon=0.05),
        ),
    ],
)
@torch.no_grad()
def test_interval_compression_equals_a_plain_reimplementation(tiny, name, params, score):
    """Four compressions in 20 decode tokens, each to 10 of what the cache holds: the same tokens and logits as the
    re-implementation; each KV head holds TARGET plus the 4 tokens fed since (the fifth compression comes before the
    next forward), and held at most the prompt and 4 tokens."""
    model, _ = tiny
    tokens, logits = reference(model, prompt_ids(), score)
    mine, my_logits, cache = interval_run(model, prompt_ids(), make_policy(name, 1.0, **params))
    assert torch.equal(mine, tokens)
    torch.testing.assert_close(my_logits, logits, rtol=0, atol=1e-4)
    held = [int(layer.held.sum(-1).max()) for layer in cache.layers]
    assert held == [TARGET + EVERY] * len(held)
    assert cache.peak_entries == PROMPT + EVERY


def test_held_scores_order_each_heads_tokens_by_position_whatever_it_holds():
    """The held keys and values a ``scores_held`` policy scores are each KV head's, in position order, whatever slots
    they sit in and however many each head holds; free slots score 0."""
    from h2o_eval.decode import Slots
    from h2o_eval.interval import Steps, held_scores

    generator = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 3, 9, 4, generator=generator), torch.randn(2, 3, 9, 4, generator=generator)
    position = torch.stack([torch.randperm(9, generator=generator) for _ in range(6)]).view(2, 3, 9)
    held = torch.rand(2, 3, 9, generator=generator) < 0.7
    held[0, 0], held[1, 2] = True, False
    held[1, 2, :5] = True
    policy = make_policy("cur", 1.0, num_sinks=2, local_window_size=4)
    found = held_scores(policy, 0, Slots(keys, values, held, position, torch.zeros(2, 3, 9)), 4, Steps(None), None)
    for row in range(2):
        for head in range(3):
            slot = torch.where(held[row, head], position[row, head], 99).argsort()[: int(held[row, head].sum())]
            ordered = (keys[row, head, slot].view(1, 1, -1, 4), values[row, head, slot].view(1, 1, -1, 4))
            expected = cur_scores(None, 0, *ordered, [], 0, window=4, sinks=2)[0, 0]
            torch.testing.assert_close(found[row, head, slot], expected)
            assert not found[row, head][~held[row, head]].any()
    assert len({int(count) for count in held.sum(-1).flatten()}) > 2  # heads holding different numbers


def interval_policies() -> list[tuple[str, dict]]:
    """Every registered policy ``decoding=interval`` takes as its decoding policy, with its example parameters, and
    the wrappers that may be one over a base that may."""
    found = []
    for name in POLICIES:
        try:
            refuse_interval_policy(example_policy(name, 1.0))
        except ConfigError:
            continue
        found.append((name, {}))
    return found + [("adakv", {"base": "knorm"}), ("criticalkv", {"base": "keydiff"})]


@pytest.mark.parametrize(
    ("name", "params"),
    fast_sample(interval_policies(), lambda case: case in (("knorm", {}), ("cur", {}), ("adakv", {"base": "knorm"}))),
    ids=[f"{name}-{params['base']}" if params else name for name, params in interval_policies()],
)
@torch.no_grad()
def test_replayed_interval_steps_equal_eager_ones(tiny, name, params):
    """Every decoding policy under emulated graphs gives the eager tokens. One that scores keys (or what is held)
    without votes has its steps captured: each compression lays the buffers out anew (heads holding different
    numbers under adakv), so the next step warms up and is captured again. One that votes keeps its steps'
    attention input, and decodes eagerly."""
    model, _ = tiny
    policy = example_policy(name, 1.0) if not params else make_policy(name, 1.0, **params)
    tokens, logits, _ = interval_run(model, prompt_ids(), policy)
    replayed, replayed_logits, cache = interval_run(model, prompt_ids(), policy, graphs=True)
    assert torch.equal(replayed, tokens)
    torch.testing.assert_close(replayed_logits, logits, rtol=0, atol=1e-5)
    votes = any(layer.steps and layer.steps.keeps for layer in cache.layers)
    assert cache.graphs.replays == 0 if votes else cache.graphs.replays >= 8


def test_interval_settings_are_checked_in_one_line(tiny):
    model, _ = tiny
    policy = make_policy("knorm", 0.5)
    refusals = [
        (lambda: Interval(0), "compression_interval=0: use an integer >= 1"),
        (lambda: Interval(8, target_size=4, target_ratio=0.5), "target_size or target_ratio, not both"),
        (lambda: Interval(8, target_ratio=1.0), "target_ratio=1.0: use a fraction in \\[0, 1\\)"),
        (lambda: Interval(8, policy=make_policy("kvzip", 0.5)), "policy 'kvzip' scores a prompt by its own pass"),
        (lambda: Interval(8, policy=make_policy("chunk", 0.5)), "policy 'chunk' wraps a base policy in a way"),
        (lambda: Interval(8, policy=make_policy("adakv", 0.5, base="kvzip")), "policy 'kvzip' scores a prompt"),
        (lambda: EvictionCache(model, policy, protocol="context", interval=Interval(8)), "drop them"),
        (lambda: EvictionCache(model, make_policy("full", 1.0), decoding="interval"), "protocol=prefill or context"),
    ]
    for make, message in refusals:
        with pytest.raises(ConfigError, match=message):
            make()
    assert Interval(8, target_ratio=0.75).target(103) == 25 and Interval(8).target(10**6) == 2048


def test_a_run_under_decoding_interval_names_its_settings_and_records_the_generated_length(tmp_path, data_dir):
    """``decoding=interval`` from the CLI's config: its record is named ``context-interval``, its ``interval.*``
    settings depart from the defaults and are identity only under it; a bad one is refused before the model loads;
    the record carries the tokens generated."""
    from conftest import make_config

    from h2o_eval import results
    from h2o_eval.run import run, validate

    settings = dict(model="tiny-llama", task="niah_single_1", policy="snapkv", budget=0.5, protocol="context")
    settings |= {"task.length": 256, "task.max_new_tokens": 12, "limit": 1, "policy.window": 4}
    interval = {"decoding": "interval", "interval.compression_interval": 4, "interval.target_size": 40}
    spec = validate(make_config(data_dir, tmp_path, **settings, **interval, **{"interval.policy": "knorm"}))
    assert "__context-interval__" in spec.path.name
    assert spec.departures["interval.policy"] == "knorm" and spec.departures["interval.compression_interval"] == 4
    other = validate(make_config(data_dir, tmp_path, **settings, **(interval | {"interval.target_size": 41})))
    assert other.path != spec.path
    spelled = validate(make_config(data_dir, tmp_path, **settings, **interval, **{"interval.policy": "{name:knorm}"}))
    assert spelled.path == spec.path and spec.identity["interval"]["policy"] == make_policy("knorm", 1.0).describe()
    grown = make_config(data_dir, tmp_path, **settings, decoding="grow")
    assert results.record_path(tmp_path, {**grown, "interval": {"compression_interval": 3}}) == validate(grown).path
    with pytest.raises(ConfigError, match="interval.policy=3: use a policy name"):
        validate(make_config(data_dir, tmp_path, **settings, **interval, **{"interval.policy": 3}))
    record = run(make_config(data_dir, tmp_path, **settings, **interval), tmp_path)
    assert record["generation"]["generated_tokens_mean"] > 4
    assert results.record_identity(record) == validate(make_config(data_dir, tmp_path, **settings, **interval)).identity


@torch.no_grad()
def test_observed_attention_scores_what_is_held_by_the_compressing_forwards_eager_weights(tiny):
    """Independent path: the model's own eager attention weights of a forward of several rows (output_attentions),
    summed over its rows, divided by n, n - 1, ..., 1 and averaged over each KV head's query heads, as kvpress's
    ObservedAttentionPress scores them in its DecodingPress, equal the scores rebuilt from that forward's attention
    input, for every KV head and for a subset."""
    from h2o_eval.policies.inputs import Prompt

    model, _ = tiny
    ids, layer = prompt_ids(), 1
    attention = model.model.layers[layer].self_attn
    inputs = []
    hook = attention.register_forward_pre_hook(lambda m, a, kw: inputs.append(kw["hidden_states"]), with_kwargs=True)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        cache = DynamicCache()
        model(ids[:, :-5], cache=cache)
        weights = model(ids[:, -5:], cache=cache, output_attentions=True).attentions[layer]  # [1, Hq, 5, T]
    finally:
        model.set_attn_implementation(previous)
        hook.remove()
    kv_heads, length = model.config.num_key_value_heads, PROMPT
    expected = (weights.sum(2) / torch.arange(length, 0, -1)).view(1, kv_heads, -1, length).mean(2)
    keys, values = cache.layers[layer].keys, cache.layers[layer].values

    def rotary(at):
        cos, sin = model.model.rotary_emb(keys, at.view(1, -1))
        return cos[0], sin[0]

    for heads in (torch.arange(kv_heads), torch.tensor([kv_heads - 1])):
        held = Prompt(
            module=attention, layer=layer, query=keys.new_zeros(1, model.config.num_attention_heads, 0, keys.shape[-1]),
            key=keys[:, heads], value=values[:, heads], position=torch.arange(length).view(1, -1),
            real=torch.ones(1, length, dtype=torch.bool), capacity=torch.full((1, len(heads)), 8),
            hidden_states=inputs[-1], rotary=rotary, scaling=attention.scaling,
        )  # fmt: skip
        found = make_policy("observed_attention", 1.0).held_scores(held, heads)
        torch.testing.assert_close(found, expected[:, heads], rtol=1e-5, atol=1e-6)


def adakv_reference(model, ids, alpha=0.2):
    """Greedy tokens and logits of a full DynamicCache whose (layer, KV head) pairs stop attending to the tokens an
    Ada-KV compression of key norms drops every EVERY decode tokens: each head's floor(alpha * TARGET) best it still
    attends to first, then the layer's best (score, position, head) until the heads attend to Hkv * TARGET; and the
    positions each pair attends to at the end."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    alive = [torch.ones(kv_heads, PROMPT, dtype=torch.bool) for _ in range(layers)]

    def masked(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        assert query.shape[2] == 1  # one token: every held key is visible but the dropped
        seen = alive[module.layer_idx]
        group = query.shape[1] // kv_heads
        mask = torch.zeros(1, query.shape[1], 1, key.shape[2])
        mask[0, :, 0, : seen.shape[1]] = torch.where(seen, 0.0, float("-inf")).repeat_interleave(group, dim=0)
        return eager_attention_forward(module, query, key, value, mask, scaling, dropout)

    AttentionInterface.register("adakv_reference", masked)
    previous = model.config._attn_implementation
    cache = DynamicCache()
    logits = [model(ids, cache=cache).logits[0, -1]]
    model.set_attn_implementation("adakv_reference")
    try:
        for step in range(NEW - 1):
            token = logits[-1].argmax().view(1, 1)
            for index in range(layers):
                alive[index] = torch.cat([alive[index], torch.ones(kv_heads, 1, dtype=torch.bool)], dim=1)
            logits.append(model(token, cache=cache, position_ids=torch.tensor([[PROMPT + step]])).logits[0, -1])
            if (step + 1) % EVERY or step == NEW - 2:  # h2o_eval compresses before the next forward: none comes
                continue
            for index, layer in enumerate(cache.layers):
                scores = (-layer.keys[0].norm(dim=-1)).tolist()  # [Hkv][T]
                candidates = [
                    (scores[head][at], at, head) for head in range(kv_heads) for at in range(len(scores[head]))
                    if alive[index][head, at]
                ]  # fmt: skip
                candidates.sort(reverse=True)
                kept = set()
                for head in range(kv_heads):
                    kept |= set([c for c in candidates if c[2] == head][: int(alpha * TARGET)])
                kept |= set([c for c in candidates if c not in kept][: kv_heads * TARGET - len(kept)])
                alive[index] = torch.zeros_like(alive[index])
                for _, at, head in kept:
                    alive[index][head, at] = True
    finally:
        model.set_attn_implementation(previous)
    logits = torch.stack(logits)
    ends = [[torch.where(seen[head])[0].tolist() for head in range(kv_heads)] for seen in alive]
    return logits.argmax(-1), logits, ends


@torch.no_grad()
def test_adakv_interval_compressions_equal_a_cache_that_masks_what_they_drop(tiny):
    """``adakv`` over ``knorm`` as the decoding policy: four compressions in 20 decode tokens, each sharing the
    layer's Hkv * TARGET slots over what its heads hold (each guaranteed floor(0.2 * TARGET)). The same tokens and
    logits as a full cache whose heads stop attending to what the compressions drop, the same tokens held by each
    (layer, KV head) at the end, and heads that hold different numbers of tokens."""
    model, _ = tiny
    tokens, logits, ends = adakv_reference(model, prompt_ids())
    mine, my_logits, cache = interval_run(model, prompt_ids(), make_policy("adakv", 1.0, base="knorm"))
    assert torch.equal(mine, tokens)
    torch.testing.assert_close(my_logits, logits, rtol=0, atol=1e-4)
    held = [
        [sorted(layer.position[0][head][layer.held[0, head]].tolist()) for head in range(2)] for layer in cache.layers
    ]
    assert held == ends
    assert len({len(head) for layer in held for head in layer}) > 1


@torch.no_grad()
def test_tova_over_the_layer_keeps_one_set_of_tokens_through_compressions_and_later_chunks(tiny):
    model, _ = tiny
    policy = make_policy("tova", 0.5, heads="layer")
    cache = EvictionCache(model, policy, protocol="context", decoding="interval", interval=Interval(4, target_size=20))
    ids = prompt_ids()
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, cache=cache)
    more = torch.cat([out, torch.randint(5, 250, (ids.shape[0], 8))], 1)  # a chunk after the compressions
    model.generate(more, max_new_tokens=3, do_sample=False, pad_token_id=0, cache=cache)
    for layer in cache.layers:
        held = [sorted(layer.position[0, h][layer.held[0, h]].tolist()) for h in range(layer.held.shape[1])]
        assert all(positions == held[0] for positions in held) and len(held[0]) < more.shape[1]
