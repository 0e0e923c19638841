"""``decoding=interval`` (kvpress's DecodingPress): every ``steps`` forwards after the prompt the cache is compressed
to the target by the decoding policy's scores. Reference: a plain re-implementation over transformers' own
``DynamicCache``, fed token by token, its keys scored by hand every ``steps`` tokens (key norms; SnapKV's window
votes from the attention inputs a hook kept) and cut to the target, ties to the newest token."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from h2o_eval import EvictionCache, load_model, make_policy
from h2o_eval.errors import ConfigError
from h2o_eval.graphs import DecodeGraphs, RecordedGraph, install
from h2o_eval.policies import Interval

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
    cache = EvictionCache(model, make_policy("full", 1.0), protocol="context", decoding="interval", interval=interval)
    if graphs:
        cache.graphs = DecodeGraphs(cache, RecordedGraph)
        install(model)
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


@pytest.mark.parametrize("name", ["knorm", "cur"])
@torch.no_grad()
def test_replayed_interval_steps_equal_eager_ones(tiny, name):
    """A decoding policy that scores keys (or what is held) without votes has its steps captured: each compression
    lays the buffers out anew, so the next step warms up and is captured again; the replays give the eager tokens."""
    model, _ = tiny
    tokens, logits, _ = interval_run(model, prompt_ids(), make_policy(name, 1.0))
    replayed, replayed_logits, cache = interval_run(model, prompt_ids(), make_policy(name, 1.0), graphs=True)
    assert torch.equal(replayed, tokens)
    torch.testing.assert_close(replayed_logits, logits, rtol=0, atol=1e-5)
    assert cache.graphs.replays >= 8


def test_interval_settings_are_checked_in_one_line(tiny):
    model, _ = tiny
    policy = make_policy("knorm", 0.5)
    refusals = [
        (lambda: Interval(0), "compression_interval=0: use an integer >= 1"),
        (lambda: Interval(8, target_size=4, target_ratio=0.5), "target_size or target_ratio, not both"),
        (lambda: Interval(8, target_ratio=1.0), "target_ratio=1.0: use a fraction in \\[0, 1\\)"),
        (lambda: Interval(8, policy=make_policy("kvzip", 0.5)), "policy 'kvzip' scores a prompt by its own pass"),
        (lambda: Interval(8, policy=make_policy("adakv", 0.5)), "policy 'adakv' wraps a base policy"),
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
