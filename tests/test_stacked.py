"""Stacked caches: several compressed caches answer one batch, each row as its cache alone, rows leaving as their
answers end."""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import make_config

from h2o_eval import generation, groups
from h2o_eval.cache import EvictionCache
from h2o_eval.errors import ConfigError
from h2o_eval.graphs import RecordedGraph
from h2o_eval.groups import Group, SharedPrompt, runs
from h2o_eval.models import load_model
from h2o_eval.policies import make_policy
from h2o_eval.run import validate


@pytest.mark.parametrize(("name", "length"), [("tiny-llama", 48), ("tiny-llama", 200), ("tiny-gemma3", 48)])
def test_a_stack_decodes_each_cache_as_alone_and_leaves_the_caches_as_they_were(name, length):
    """Reference: each compressed cache (a full cache and H2O, SnapKV and StreamingLLM at budgets whose slots differ
    in number) decoding a question alone; implementation: the same caches stacked, decoding it in one batch, in one
    call per group of rows that hold about as many tokens (one group at 48 tokens of context, three at 200). Every
    row generates the tokens its own cache generates alone, and the stacked caches still hold what they held."""
    model, _ = load_model(name, device="cpu")
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(5, model.config.vocab_size, (2, length), generator=generator)
    prompt = torch.cat([context, torch.randint(5, model.config.vocab_size, (2, 6), generator=generator)], 1)
    cells = [("full", 1.0), ("h2o", 0.3), ("snapkv", 0.5), ("streaming", 0.2)]
    settings = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False, "pad_token_id": 0}

    def compressed():
        caches = [EvictionCache(model, make_policy(p, budget=b), protocol="context", decoding="grow") for p, b in cells]
        generation.feed(model, SharedPrompt(caches), context, torch.ones_like(context))
        return caches

    alone = [
        generation.decode(model, cache, prompt, torch.ones_like(prompt), **settings)[:, prompt.shape[1] :]
        for cache in compressed()
    ]
    assert len({tuple(a.flatten().tolist()) for a in alone}) > 2, "the caches should answer differently here"
    caches = compressed()
    before = [[(layer.keys.clone(), layer.held.clone()) for layer in cache.layers] for cache in caches]
    held = {int(next(layer for layer in cache.layers if layer.window is None).held.sum()) for cache in caches}
    assert len(held) == len(cells), "the caches should hold different numbers of slots"
    stacked = EvictionCache.stack(caches)
    together = generation.decode(model, stacked, prompt.repeat(len(cells), 1), None, **settings)
    assert torch.equal(together[:, prompt.shape[1] :], torch.cat(alone))
    decodes = [layer.decode for layer in stacked.layers if layer.decode is not None]
    assert decodes and all(len(decode.groups) == (3 if length == 200 else 1) for decode in decodes)
    for cache, held in zip(caches, before, strict=True):
        for layer, (keys, slots) in zip(cache.layers, held, strict=True):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.held, slots)


@pytest.mark.parametrize(("name", "length"), [("tiny-llama", 48), ("tiny-llama", 200), ("tiny-gemma3", 48)])
def test_rows_leave_a_stack_as_their_answers_end_and_generate_what_they_generate_carried_to_the_end(
    name, length, monkeypatch
):
    """Reference: a stack of compressed caches decoding a question in one ``generate``, every row carried to the
    longest answer; implementation: :func:`decode_leaving`, each row leaving the batch at its end of sequence (a
    token the rows generate at different steps), the rows that go on attended where they are (runs of a group's
    buffer rows) and copied alone when their group widens. The same sequences, and ``generate`` ran again as rows
    left; a group attended rows apart and widened with fewer rows than it had."""
    model, _ = load_model(name, device="cpu")
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(5, model.config.vocab_size, (2, length), generator=generator)
    prompt = torch.cat([context, torch.randint(5, model.config.vocab_size, (2, 6), generator=generator)], 1)
    cells = [("full", 1.0), ("h2o", 0.3), ("snapkv", 0.5), ("streaming", 0.2)]
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}

    def stacked():
        caches = [EvictionCache(model, make_policy(p, budget=b), protocol="context", decoding="grow") for p, b in cells]
        generation.feed(model, SharedPrompt(caches), context, torch.ones_like(context))
        return EvictionCache.stack(caches)

    ids = prompt.repeat(len(cells), 1)
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    free = generation.decode(model, stacked(), ids, None, **settings)[:, ids.shape[1] :]
    ends = sorted({int(free[row, 2 + row]) for row in range(6)})  # a token of each of six rows, each at its own step
    steps = [next((step for step, token in enumerate(row) if token in ends), None) for row in free.tolist()]
    assert len(set(steps)) >= 4, "rows should end at different steps here, or the test proves little"
    monkeypatch.setattr(model.generation_config, "eos_token_id", ends)
    carried = generation.decode(model, stacked(), ids, torch.ones_like(ids), **settings)
    calls, decode = [], generation.passes.decode
    monkeypatch.setattr(generation.passes, "decode", lambda *a, **k: calls.append(a[2].shape[0]) or decode(*a, **k))
    widenings, prepare = [], Group.prepare

    def widening(group, n):
        wider = prepare(group, n)
        widenings.extend([] if wider is group else [(group.slots.held.shape[0], wider.slots.held.shape[0])])
        return wider

    monkeypatch.setattr(Group, "prepare", widening)
    monkeypatch.setattr(groups, "ROOM", 0)  # no room beyond a bucket: the groups widen within the answers
    apart = []
    monkeypatch.setattr(groups, "runs", lambda physical: apart.append(len(runs(physical)) > 1) or runs(physical))
    leaving = generation.passes.decode_leaving(model, stacked(), ids, torch.ones_like(ids), **settings)
    assert torch.equal(leaving, carried[:, : leaving.shape[1]]) and (carried[:, leaving.shape[1] :] == 0).all()
    assert len(calls) >= 2 and calls == sorted(calls, reverse=True) and calls[-1] < len(ids)
    if length == 48:  # one group of the 8 rows, whose bucket (64 slots) is outgrown as they leave
        assert any(after < before for before, after in widenings), widenings
        assert any(apart), "a row should leave from the group's middle here"


@pytest.mark.parametrize("count", [1, 17, 61])
def test_a_stack_replays_its_decode_steps_as_graphs_and_answers_as_eagerly_while_rows_leave(count, monkeypatch):
    """Reference: ``count`` compressed caches (six policies, budgets from 0.1 to 0.95) stacked and decoded eagerly,
    rows leaving as their answers end; implementation: the same under ``graphs="emulate"``, which replays a
    captured step's aten operations with a CUDA graph's semantics. The same sequences, with steps replayed (the
    stack re-captures as rows leave: a stack of fewer rows is a stack of its own)."""
    model, _ = load_model("tiny-llama", device="cpu")
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(5, model.config.vocab_size, (1, 48), generator=generator)
    prompt = torch.cat([context, torch.randint(5, model.config.vocab_size, (1, 6), generator=generator)], 1)
    names = ["full", "h2o", "snapkv", "streaming", "tova", "knorm"]
    cells = [(names[i % len(names)], 0.1 + 0.85 * i / max(count - 1, 1)) for i in range(count)]
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    ids = prompt.repeat(count, 1)

    def decoded(graphs):
        caches = [
            EvictionCache(model, make_policy(p, budget=b), protocol="context", decoding="grow", graphs=graphs)
            for p, b in cells
        ]
        generation.feed(model, SharedPrompt(caches), context, torch.ones_like(context))
        stack = EvictionCache.stack(caches)
        return generation.passes.decode_leaving(model, stack, ids, torch.ones_like(ids), **settings)

    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    free = decoded(False)[:, ids.shape[1] :]
    ends = sorted({int(free[1, 3]), int(free[2, 9])}) if count > 1 else None  # rows 1 and 2 end apart
    monkeypatch.setattr(model.generation_config, "eos_token_id", ends)
    eager = decoded(False)
    replays, replay = [], RecordedGraph.replay
    monkeypatch.setattr(RecordedGraph, "replay", lambda self, owned: replays.append(self) or replay(self, owned))
    assert torch.equal(decoded("emulate"), eager)
    assert len(replays) >= 4
    if count > 1:
        assert len({int((row != 0).sum()) for row in eager[:, ids.shape[1] :]}) > 1, "rows should leave apart"
        assert len(set(replays)) >= 2, "the stack left by the rows that ended should replay captures of its own"


def test_a_stack_lets_go_of_what_its_views_held_once_it_laid_them_out_in_its_own_buffers():
    """Compressed caches stacked and let go (as the runners do): after the stack's first forward (the question's
    chunk) their keys and values are freed, as the stack decodes in buffers of its own, and it still generates what
    the caches generate alone."""
    model, _ = load_model("tiny-llama", device="cpu")
    generator = torch.Generator().manual_seed(6)
    context = torch.randint(5, model.config.vocab_size, (1, 60), generator=generator)
    prompt = torch.cat([context, torch.randint(5, model.config.vocab_size, (1, 5), generator=generator)], 1)
    cells = [("full", 1.0), ("h2o", 0.3), ("snapkv", 0.5)]
    settings = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}

    def compressed():
        caches = [EvictionCache(model, make_policy(p, budget=b), protocol="context", decoding="grow") for p, b in cells]
        generation.feed(model, SharedPrompt(caches), context, torch.ones_like(context))
        return caches

    alone = [generation.decode(model, c, prompt, None, **settings)[:, prompt.shape[1] :] for c in compressed()]
    stack = EvictionCache.stack(compressed())
    held = [weakref.ref(layer.slots.keys) for view in stack.views for layer in view.layers]
    assert all(ref() is not None for ref in held)
    together = generation.decode(model, stack, prompt.repeat(len(cells), 1), None, **settings)
    assert torch.equal(together[:, prompt.shape[1] :], torch.cat(alone))
    assert all(ref() is None for ref in held), "the views' keys should be freed"


def test_a_group_attends_the_rows_that_go_on_by_runs_of_its_buffer_rows():
    """Runs of consecutive buffer rows, each with where it starts among the rows that go on."""
    assert runs([0, 1, 2]) == [(0, 3, 0)]
    assert runs([0, 2, 3, 7]) == [(0, 1, 0), (2, 4, 1), (7, 8, 3)]
    assert runs([5]) == [(5, 6, 0)]


def test_a_stack_going_on_with_some_rows_copies_only_the_caches_that_lose_rows():
    """StackedCache.rows: a view that keeps all its rows goes on as it is (no copy while rows leave), one that keeps
    some goes on as a copy of those rows alone, one that keeps none leaves."""
    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    caches = []
    for budget in (0.3, 0.5, 0.7):
        caches.append(EvictionCache(model, make_policy("h2o", budget=budget), protocol="context", decoding="grow"))
        with torch.no_grad():
            model(ids, cache=caches[-1], use_cache=True)
    stacked = EvictionCache.stack(caches)
    kept = stacked.rows([0, 1, 3])
    assert kept.views[0] is stacked.views[0] and len(kept.views) == 2 and kept.lengths == [40, 40, 40]
    assert kept.views[1] is not stacked.views[1] and len(kept.views[1].lengths) == 1
    held = [layer.held for layer in stacked.views[1].layers]
    assert all(torch.equal(a.held, b[1:]) for a, b in zip(kept.views[1].layers, held, strict=True))


def test_only_compressed_caches_that_evict_nothing_more_and_saw_the_same_tokens_are_stacked():
    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))

    def fed(decoding, tokens):
        cache = EvictionCache(model, make_policy("h2o", budget=0.3), protocol="context", decoding=decoding)
        with torch.no_grad():
            model(tokens, cache=cache, use_cache=True)
        return cache

    assert EvictionCache.stack([fed("grow", ids), fed("grow", ids)]).lengths == [40, 40]
    with pytest.raises(ValueError, match="decoding=grow"):
        EvictionCache.stack([fed("grow", ids), fed("evict", ids)])
    with pytest.raises(ValueError, match="seen different tokens"):
        EvictionCache.stack([fed("grow", ids), fed("grow", ids[:, :30])])


@pytest.mark.parametrize(
    "settings", [{}, {"protocol": "prefill", "decoding": "grow"}, {"protocol": "turns", "task.questions": 2}]
)
def test_stacking_cells_needs_the_context_or_turns_protocol_and_grow(data_dir, tmp_path, settings):
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="niah_single_1", stack_cells=True, **settings)
    with pytest.raises(ConfigError, match="stack_cells=true .* protocol=context or turns, decoding=grow only"):
        validate(config)
