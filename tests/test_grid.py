"""One prompt pass for many policies: a :class:`SharedPrompt` leaves every cache as feeding it alone would, shared
cells answer as separate runs, and ``python -m h2o_eval.grid`` writes the records ``python -m h2o_eval`` would."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import time
import weakref

import pytest
import torch
from conftest import make_config, registered

from h2o_eval import generation, grid
from h2o_eval.cache import EvictionCache
from h2o_eval.errors import ConfigError
from h2o_eval.groups import SharedPrompt
from h2o_eval.models import load_model
from h2o_eval.policies import configured_policy, example_policy, make_policy
from h2o_eval.run import execute, validate
from h2o_eval.runners.long_context import RUNNER

# A fixed set of cells for the grid's own mechanics (configs need each policy's conf/policy YAML).
POLICIES = [("full", 1.0), ("h2o", 0.3), ("tova", 0.3), ("snapkv", 0.3), ("adakv", 0.4), ("knorm", 0.3)]
POLICIES += [("streaming", 0.3), ("local", 0.25)]


@pytest.mark.parametrize("name", ["tiny-llama", pytest.param("tiny-gemma3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("protocol", [pytest.param("prefill", marks=pytest.mark.slow), "context"])
def test_a_shared_prompt_leaves_each_cache_as_feeding_it_alone(name, protocol):
    """Reference: each policy's cache fed the (left-padded) prompt through a SharedPrompt of its own (no vote or
    prompt computation shared) and, apart, as an EvictionCache alone; implementation: one pass of the prompt through
    a SharedPrompt of all of them. Every layer of every cache is bit for bit its own SharedPrompt's: held slots,
    positions, keys, scores and kept tokens. A shared pass differs from the cache's own only in how the attention's
    output is rounded (computed once, as the full cache computes it), which reaches the later layers' inputs and may
    tip a choice made on a tie, such as entropy_gated_chunkkv's entropies one ulp apart at their median (torch
    2.13). So the first layer, fed the same inputs, is bit for bit the cache's own, and the shared pass's logits are
    the full cache's up to rounding. tiny-gemma3 has sliding layers, which keep their own window."""
    model, _ = load_model(name, device="cpu")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(5, model.config.vocab_size, (2, 300), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :13] = 0

    def caches():
        return [EvictionCache(model, example_policy(name, 0.3), protocol=protocol) for name in registered(protocol)]

    def feed(cache):
        with torch.no_grad():
            return model(ids, attention_mask=mask, cache=cache, use_cache=True).logits

    alone = caches()
    logits = [feed(cache) for cache in alone]
    own = caches()
    for cache in own:
        feed(SharedPrompt([cache]))
    together = caches()
    shared_logits = feed(SharedPrompt(together))
    full = registered(protocol).index("full")
    torch.testing.assert_close(shared_logits, logits[full], rtol=1e-4, atol=1e-4)
    evicted = 0
    for policy, one, mine, other in zip(registered(protocol), alone, own, together, strict=True):
        for depth, (a, b) in enumerate(zip(mine.layers, other.layers, strict=True)):
            assert a.seen == b.seen, (policy, depth)
            for field in ("held", "position", "keys", "scores", "kept"):
                assert equal_or_none(getattr(a, field), getattr(b, field)), (policy, depth, field)
            evicted += int((~a.held).sum()) + (a.held.shape[-1] < 300) if a.window is None else 0
        first, shared_first = one.layers[0], mine.layers[0]
        for field in ("held", "position", "keys", "scores", "kept"):
            assert equal_or_none(getattr(first, field), getattr(shared_first, field)), (policy, field)
    assert evicted > 0


def equal_or_none(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


def fed(model, ids, mask, policies):
    """Context-protocol caches of ``policies`` after one SharedPrompt pass of the left-padded ``ids``."""
    caches = [EvictionCache(model, p, protocol="context") for p in policies]
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=SharedPrompt(caches), use_cache=True)
    return caches


def test_caches_whose_rules_weigh_the_prompt_alike_compute_its_votes_once(monkeypatch):
    """Reference: each cache fed through a SharedPrompt of its own, computing its prompt's votes; implementation:
    H2O at three budgets and TOVA in one SharedPrompt, where H2O's votes (every prompt row weighed alike) are
    computed once per layer and TOVA's (its last row only) once more. Every cache's held slots and scores are
    exactly the reference's."""
    from h2o_eval.kernels import prompt

    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, model.config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    policies = [make_policy("h2o", b) for b in (0.2, 0.4, 0.6)] + [make_policy("tova", 0.3)]

    alone = [fed(model, ids, mask, [p])[0] for p in policies]
    calls, computed = [], prompt.column_scores_reference  # what the CPU path's prompt_votes runs
    monkeypatch.setattr(prompt, "column_scores_reference", lambda *a, **k: calls.append(1) or computed(*a, **k))
    together = fed(model, ids, mask, policies)
    assert len(calls) == 2 * model.config.num_hidden_layers
    for one, other in zip(alone, together, strict=True):
        for a, b in zip(one.layers, other.layers, strict=True):
            assert torch.equal(a.held, b.held) and torch.equal(a.scores, b.scores)


def test_policies_at_several_budgets_score_a_shared_prompt_once(monkeypatch):
    """Reference: each cache fed through a SharedPrompt of its own; implementation: Expected Attention at three
    budgets and CriticalKV (whose base is Expected Attention without the value norm) at two, in one SharedPrompt,
    the second row left-padded. Per layer, Expected Attention's softmax is computed once for both (they differ only
    in the value norms applied after it) and CriticalKV's projected value norms once; every cache's held slots and
    scores are exactly the reference's."""
    from h2o_eval.policies import criticalkv
    from h2o_eval.policies.expected_attention import ExpectedAttention

    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, model.config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    policies = [make_policy("expected_attention", b) for b in (0.2, 0.4, 0.6)]
    policies += [make_policy("criticalkv", b) for b in (0.3, 0.5)]

    alone = [fed(model, ids, mask, [p])[0] for p in policies]
    expected, norms = [], []
    scorer, projected = ExpectedAttention._expected, criticalkv.projected_value_norm
    monkeypatch.setattr(ExpectedAttention, "_expected", lambda *a: expected.append(1) or scorer(*a))
    monkeypatch.setattr(criticalkv, "projected_value_norm", lambda *a: norms.append(1) or projected(*a))
    together = fed(model, ids, mask, policies)
    layers = model.config.num_hidden_layers
    assert (len(expected), len(norms)) == (layers, layers)
    for one, other in zip(alone, together, strict=True):
        for a, b in zip(one.layers, other.layers, strict=True):
            assert torch.equal(a.held, b.held) and torch.equal(a.scores, b.scores)
            assert int(b.held.sum()) < int(mask.sum()) * b.held.shape[1]  # the prompt was compressed


@pytest.mark.slow
def test_shared_cells_answer_as_separate_runs(data_dir, tmp_path):
    """Reference: the long-context runner's evaluate, one cell at a time; implementation: evaluate_shared over all
    the cells, in both protocols, batches of 3 documents of 2 questions (whose lengths differ, so the context protocol
    answers them in groups of one length from copies of the compressed cache). Under context, policies that score by
    extra passes (KVzip's repeat, the oracle's answer) follow cells that answered in groups."""
    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 6, "batch_size": 3}
    settings |= {"task.length": 700, "task.max_new_tokens": 8, "task.questions": 2}
    passes = [("kvzip", 0.3), ("expected_attention", 0.3), ("oracle", 0.3)]
    cells = [(p, "prefill", b) for p, b in POLICIES[:4]] + [(p, "context", b) for p, b in POLICIES[3:] + passes]
    configs = [
        validate(make_config(data_dir, tmp_path, **settings, policy=p, protocol=protocol, budget=b)).config
        for p, protocol, b in cells
    ]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    answers = set()
    for one, together in zip(separate, shared, strict=True):
        fields, outputs, shared_fields, shared_outputs = one.fields, one.outputs, together.fields, together.outputs
        keys = ("id", "prediction", "capacity", "generated_tokens", "scores")
        assert [[o[k] for k in keys] for o in shared_outputs] == [[o[k] for k in keys] for o in outputs]
        assert shared_fields["capacity"] == fields["capacity"] and shared_fields["metrics"] == fields["metrics"]
        assert shared_fields["generation"]["kv_peak_entries"] == fields["generation"]["kv_peak_entries"]
        answers.add(tuple(o["prediction"] for o in outputs))
    assert len(answers) > 2, "the policies should answer differently here, or the test proves little"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_stacked_cells_answer_as_separate_runs(data_dir, tmp_path, monkeypatch, name):
    """Reference: each cell evaluated alone; implementation: evaluate_shared with ``stack_cells``, where every cell
    but the oracle's answers each group of questions in one batch from its own stacked compressed cache, with a
    full copy of the context whose answer the oracle's two cells then compress for, answering in a second batch
    (protocol=context, decoding=grow; one document's two questions, each answered from stacked copies).
    Answers, capacities, kept entries, generated tokens, the KV peak and the full cache's entries (each cell's
    generation as long as it would have run alone, though the batch runs on for other cells' rows) are the
    separate runs'; the generations really ran stacked, two per question and no other, and the caches each stack
    was made of were freed before it decoded (its views hold what they held). tiny-gemma3 has sliding layers,
    stacked as they are."""
    settings = {"model": name, "task": "niah_single_1", "limit": 1, "batch_size": 1, "decoding": "grow"}
    settings |= {"task.length": 600, "task.max_new_tokens": 8, "task.questions": 2, "protocol": "context"}
    cells = POLICIES[1:] + [("full", 1.0), ("kvzip", 0.3), ("expected_attention", 0.2), ("oracle", 0.3)]
    cells += [("oracle", 0.6)]
    configs = [
        validate(make_config(data_dir, tmp_path, **settings, policy=p, budget=b, stack_cells=True)).config
        for p, b in cells
    ]
    model, tokenizer = load_model(name, device="cpu")
    # An end of sequence these random models generate in some answers only, so rows of one batch stop apart.
    model.generation_config.eos_token_id = {"tiny-llama": 11746, "tiny-gemma3": 13437}[name]
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    lengths = {o["generated_tokens"] for one in separate for o in one.outputs}
    assert len(lengths) > 1 and max(lengths) == 8, "answers should stop at different steps, or this proves little"
    batches, calls, made, freed = [], [], [], []
    leaving, decode, stack = generation.passes.decode_leaving, generation.passes.decode, EvictionCache.stack.__func__

    def stacked(model, cache, ids, *args, **kwargs):
        batches.append(len(ids))
        gc.collect()
        freed.append(all(ref() is None for ref in made[-1]))
        return leaving(model, cache, ids, *args, **kwargs)

    def remembered(cls, caches):
        made.append([weakref.ref(cache) for cache in caches])
        return stack(cls, caches)

    monkeypatch.setattr(EvictionCache, "stack", classmethod(remembered))
    monkeypatch.setattr("h2o_eval.generation.answering.decode_leaving", stacked)
    monkeypatch.setattr(
        "h2o_eval.generation.passes.decode", lambda m, c, i, *a, **k: calls.append(len(i)) or decode(m, c, i, *a, **k)
    )
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    assert batches == [len(cells) - 1, 2] * 2, "per question, the others and a full copy, then the oracle's cells"
    assert freed == [True] * 4, "the caches a stack is made of should be freed while it decodes (its views hold them)"
    assert len(calls) > len(batches) and calls[1] < calls[0], "rows should have left the batch as their answers ended"
    answers = set()
    keys = ("id", "prediction", "capacity", "generated_tokens", "scores", "kv_entries", "prompt_tokens")
    for one, together in zip(separate, shared, strict=True):
        assert [[o[k] for k in keys] for o in together.outputs] == [[o[k] for k in keys] for o in one.outputs]
        assert together.fields["capacity"] == one.fields["capacity"]
        for field in ("kv_peak_entries", "kv_full_entries", "generated_tokens_mean"):
            assert together.fields["generation"][field] == one.fields["generation"][field], field
        answers.add(tuple(o["prediction"] for o in one.outputs))
    assert len(answers) > 2, "the policies should answer differently here, or the test proves little"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_stack_decodes_each_cache_as_alone_and_leaves_the_caches_as_they_were(name):
    """Reference: each compressed cache (a full cache and H2O, SnapKV and StreamingLLM at budgets whose slots differ
    in number) decoding a question alone; implementation: the same caches stacked, decoding it in one batch. Every
    row generates the tokens its own cache generates alone, and the stacked caches still hold what they held."""
    model, _ = load_model(name, device="cpu")
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(5, model.config.vocab_size, (2, 48), generator=generator)
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
    for cache, held in zip(caches, before, strict=True):
        for layer, (keys, slots) in zip(cache.layers, held, strict=True):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.held, slots)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_rows_leave_a_stack_as_their_answers_end_and_generate_what_they_generate_carried_to_the_end(name, monkeypatch):
    """Reference: a stack of compressed caches decoding a question in one ``generate``, every row carried to the
    longest answer; implementation: :func:`decode_leaving`, each row leaving the batch at its end of sequence (a
    token the rows generate at different steps). The same sequences, and ``generate`` ran again as rows left."""
    model, _ = load_model(name, device="cpu")
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(5, model.config.vocab_size, (2, 48), generator=generator)
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
    ends = {}  # a token and the rows that generate it first at a step of their own, the first three steps not
    for row in range(free.shape[0]):
        for step, token in enumerate(free[row].tolist()[:9]):
            ends.setdefault(token, {}).setdefault(row, step)
    token = max(ends, key=lambda t: (len(set(ends[t].values())), len(ends[t])))
    assert len(set(ends[token].values())) >= 2, "rows should end at different steps here, or the test proves little"
    monkeypatch.setattr(model.generation_config, "eos_token_id", token)
    carried = generation.decode(model, stacked(), ids, torch.ones_like(ids), **settings)
    calls, decode = [], generation.passes.decode
    monkeypatch.setattr(generation.passes, "decode", lambda *a, **k: calls.append(a[2].shape[0]) or decode(*a, **k))
    leaving = generation.passes.decode_leaving(model, stacked(), ids, torch.ones_like(ids), **settings)
    assert torch.equal(leaving, carried[:, : leaving.shape[1]]) and (carried[:, leaving.shape[1] :] == 0).all()
    assert len(calls) >= 2 and calls == sorted(calls, reverse=True) and calls[-1] < len(ids)


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


@pytest.mark.parametrize("stack", [False, True])
def test_cells_that_differ_in_threshold_share_the_prompt_and_answer_as_separate_runs(data_dir, tmp_path, stack):
    """A sweep of thresholds (the ``dms`` of one base, kvpress's DMSPress) beside the base at a budget is one group
    of the grid; reference: each cell evaluated alone; implementation: the group's shared evaluation, its copies
    decoded one by one or stacked. Answers, capacities, kept entries and the KV peak are the separate runs', and
    the thresholds keep different shares of the context."""
    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 2, "batch_size": 2, "decoding": "grow"}
    settings |= {"task.length": 600, "task.max_new_tokens": 6, "protocol": "context", "stack_cells": stack}
    cells = [{"threshold": t} for t in (-0.7, -0.6, -0.5)] + [{"budget": 0.3}]
    specs = [validate(make_config(data_dir, tmp_path, **settings, policy="knorm", **cell)) for cell in cells]
    assert [len(group) for group in grid.groups(specs)] == [len(cells)]
    configs = [spec.config for spec in specs]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    keys = ("id", "prediction", "capacity", "generated_tokens", "kv_entries", "prompt_tokens")
    for one, together in zip(separate, shared, strict=True):
        assert [[o[k] for k in keys] for o in together.outputs] == [[o[k] for k in keys] for o in one.outputs]
        assert together.fields["capacity"] == one.fields["capacity"]
        assert together.fields["generation"]["kv_peak_entries"] == one.fields["generation"]["kv_peak_entries"]
    kept = [one.fields["capacity"]["kept_fraction_mean"] for one in separate[:3]]
    assert 1 > kept[0] > kept[1] > kept[2], f"the rising thresholds should keep falling shares here: {kept}"


def test_stacking_cells_needs_the_context_protocol_and_grow(data_dir, tmp_path):
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="niah_single_1", stack_cells=True)
    with pytest.raises(ConfigError, match="stack_cells=true .* protocol=context decoding=grow only"):
        validate(config)


@pytest.mark.slow
def test_cells_that_differ_in_budget_run_the_extra_passes_once(data_dir, tmp_path, monkeypatch):
    """Reference: KVzip's cells run one at a time, each with its own repeat passes; implementation: the cells in
    one evaluate_shared, where the three that differ only in budget run the passes once (the others take their
    scores) and a layerwise one, which scores alike but is another policy as built, runs its own. The answers,
    capacities and kept KV entries are the separate runs'."""
    from h2o_eval.policies.kvzip import KVzip

    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 4, "batch_size": 2, "protocol": "context"}
    settings |= {"task.length": 700, "task.max_new_tokens": 8, "task.questions": 2, "policy": "kvzip"}
    cells = [{"budget": b} for b in (0.2, 0.4, 0.6)] + [{"budget": 0.4, "policy.layerwise": True}]
    configs = [validate(make_config(data_dir, tmp_path, **settings, **cell)).config for cell in cells]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    passes, counted = [], KVzip.passes
    monkeypatch.setattr(KVzip, "passes", lambda self, script: passes.append(self) or counted(self, script))
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    assert len(passes) == 2 * 2, "one run of the passes per batch for the budgets, one for layerwise"
    keys = ("id", "prediction", "capacity", "kv_entries", "generated_tokens")
    for one, together in zip(separate, shared, strict=True):
        assert [[o[k] for k in keys] for o in together.outputs] == [[o[k] for k in keys] for o in one.outputs]
        assert together.fields["capacity"] == one.fields["capacity"]
    # Three budgets keep three cache sizes (layerwise keeps as many as the model-wide selection at 0.4).
    assert len({tuple(o["kv_entries"] for o in one.outputs) for one in separate}) == 3


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["context", "prefill"])
def test_the_oracle_at_several_budgets_generates_each_full_answer_once(data_dir, tmp_path, monkeypatch, protocol):
    """Reference: the oracle's cells run one at a time, each generating the full cache's answers its passes need;
    implementation: the cells in one evaluate_shared, where each prompt's full answer is generated once. The
    answers, capacities and kept KV entries are the separate runs'."""
    from h2o_eval import generation

    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 4, "batch_size": 2, "protocol": protocol}
    settings |= {"task.length": 700, "task.max_new_tokens": 8, "task.questions": 2, "policy": "oracle"}
    configs = [validate(make_config(data_dir, tmp_path, **settings, budget=b)).config for b in (0.2, 0.4, 0.6)]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    separate = [RUNNER.evaluate(model, tokenizer, configured_policy(c), c) for c in configs]
    # The full answers: under context from a copy of the cache's context, under prefill by feeding the prompt.
    owner, name = (EvictionCache, "full_copy") if protocol == "context" else (generation.passes, "answers")
    calls, answering = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: calls.append(1) or answering(*args, **kwargs))
    shared = RUNNER.evaluate_shared(model, tokenizer, [(configured_policy(c), c) for c in configs])
    questions = sum(len(o.outputs) for o in separate[:1])
    assert 0 < len(calls) <= questions, "each batch's prompts answered once, not once per budget"
    keys = ("id", "prediction", "capacity", "kv_entries", "generated_tokens")
    for one, together in zip(separate, shared, strict=True):
        assert [[o[k] for k in keys] for o in together.outputs] == [[o[k] for k in keys] for o in one.outputs]
    assert len({tuple(o["kv_entries"] for o in one.outputs) for one in separate}) == 3


@pytest.mark.parametrize("decoding", ["grow", "evict"])
def test_the_oracles_full_answers_under_context_are_the_full_caches_from_a_copy(monkeypatch, decoding):
    """Reference: a full cache fed the (left-padded) context, then answering the questions, as the ``full`` cell
    does; implementation: the oracle's cache fed the same context, whose full answers come from a copy of it
    (``EvictionCache.full_copy``), the context never fed again. The copy holds what the full cache holds, and the
    answers are the same tokens."""
    from h2o_eval import generation
    from h2o_eval.policies import Full

    model, tokenizer = load_model("tiny-llama", device="cpu")
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(5, model.config.vocab_size, (2, 90), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    questions = torch.randint(5, model.config.vocab_size, (2, 7), generator=generator)
    batch = generation.Batch(torch.cat([ids, questions], 1), torch.cat([mask, torch.ones_like(questions)], 1), 90)
    greedy = {"max_new_tokens": 12, "do_sample": False}
    full = EvictionCache(model, Full(), protocol="context", decoding=decoding)
    oracle = EvictionCache(model, make_policy("oracle", 0.3), protocol="context", decoding=decoding)
    for cache in (full, oracle):
        generation.feed(model, cache, ids, mask)
    for a, b in zip(full.layers, oracle.full_copy().layers, strict=True):
        assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("keys", "values", "held", "position"))
        assert torch.equal(a.plan.capacity, b.plan.capacity) and a.plan.unbounded and b.plan.unbounded
    sequences = generation.complete(model, full, batch, tokenizer, **greedy)
    expected = generation.new_tokens(sequences, batch.input_ids.shape[1], generation.end_tokens(tokenizer))
    assert all(len(answer) > 3 for answer in expected) and expected[0] != expected[1]
    monkeypatch.setattr(
        "h2o_eval.generation.passes.answers", lambda *args, **kwargs: pytest.fail("the context was fed again")
    )
    answered = {}
    generation.complete(model, oracle, batch, tokenizer, answered, **greedy)
    assert list(answered.values()) == [expected]


def test_only_one_prompt_under_one_scoring_shares_extra_passes():
    """A cache takes another's extra-pass scores only when their policies differ in budget alone and they hold
    the same prompt; anything else is refused in one line."""
    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))

    def fed(policy, tokens=ids):
        cache = EvictionCache(model, policy, protocol="context")
        with torch.no_grad():
            model(tokens, cache=cache, use_cache=True)
        return cache

    first = fed(make_policy("kvzip", 0.5))
    fed(make_policy("kvzip", 0.25)).adopt_rehearsal(first)
    with pytest.raises(ValueError, match="differ in budget"):
        fed(make_policy("kvzip", 0.25, layerwise=True)).adopt_rehearsal(first)
    with pytest.raises(ValueError, match="different prompts"):
        fed(make_policy("kvzip", 0.25), ids[:, :30]).adopt_rehearsal(first)


def test_a_refused_cell_names_what_sets_it_apart_once():
    """The swept overrides of a refused cell lead its line, unless the error begins with one, or with its value (a
    policy's errors begin with its name)."""
    cells = [["policy=streaming", "budget=2"], ["policy=h2o", "budget=2"]]
    said = "streaming: sinks=4 leaves no slot for recent tokens in a budget of 2 tokens"
    assert grid.refusal(cells[0], cells, said) == said
    assert grid.refusal(cells[0], cells, f"policy=streaming: {said}") == f"policy=streaming: {said}"
    assert grid.refusal(cells[1], cells, "budget too small") == "policy=h2o: budget too small"


@pytest.mark.slow
def test_the_grid_writes_the_records_a_run_would(data_dir, tmp_path, monkeypatch, capsys):
    """A sweep through the grid: shareable cells run together, a simulate cell alone, SnapKV's simulate cell is
    refused in one line (``on_error=skip``); each record sits where ``python -m h2o_eval`` looks for it (a run of
    the same cell skips), and answers as a separate run does."""
    monkeypatch.chdir(tmp_path)
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=700", "++task.max_new_tokens=6", "limit=4"]
    args += ["batch_size=2", f"data_dir={data_dir}", "results_dir=grid", "wandb.mode=disabled"]
    sweep = [*args, "policy=h2o,snapkv,full", "budget=0.3,0.5", "protocol=prefill,context,simulate", "on_error=skip"]
    with pytest.raises(SystemExit) as stopped:
        grid.main(sweep)
    out = capsys.readouterr().out
    refusals = [line for line in out.splitlines() if line.startswith("refused: ")]
    assert stopped.value.code == 1 and len(refusals) == 2 and all("policy=snapkv" in line for line in refusals)
    # full is one setting at every budget: 2 x h2o, 2 x snapkv, 1 x full per protocol, one h2o and full simulate
    assert "13 cells, 0 with records, 13 to compute, 2 refused" in out
    assert "10 cells of niah_single_1 share their prompts" in out
    assert out.count("tiny-llama | niah_single_1") == 26  # each record's line, then the summary table
    records = sorted((tmp_path / "grid").glob("*.json"))
    assert len(records) == 13
    shared = [json.loads(p.read_text()) for p in records if "prefill" in p.name or "context" in p.name]
    assert [r["generation"]["shared_prompt_cells"] for r in shared] == [10] * 10
    assert len({json.dumps(r["peak_memory"]) for r in shared}) == 1  # one peak for the cells evaluated together
    cell = {"model": "tiny-llama", "task": "niah_single_1", "task.length": 700, "++task.max_new_tokens": 6}
    cell |= {"limit": 4, "batch_size": 2, "policy": "h2o", "budget": 0.5, "protocol": "context"}
    assert execute(validate(make_config(data_dir, tmp_path / "grid", **cell)))[0] == "skipped"
    status, alone = execute(validate(make_config(data_dir, tmp_path / "alone", **cell)))
    [together] = [r for r in shared if r["policy"] == "h2o" and r["protocol"] == "context" and r["budget"] == 0.5]
    assert status == "ran" and together["metrics"] == alone["metrics"]

    def predictions(folder, record):
        lines = (folder / record["outputs"]).read_text().splitlines()
        return [json.loads(line)["prediction"] for line in lines]

    assert predictions(tmp_path / "grid", together) == predictions(tmp_path / "alone", alone)
    with pytest.raises(SystemExit):
        grid.main(sweep)
    assert "13 cells, 13 with records, 0 to compute, 2 refused" in capsys.readouterr().out


def test_a_second_grid_over_cells_in_progress_waits_and_takes_their_records(data_dir, tmp_path, monkeypatch, capsys):
    """Two grids over the same cells (two lanes, or two nodes sharing a folder): the second, started while the first
    computes them, waits for the group's lock, then takes the records the first wrote; the cells are computed once."""
    import threading

    from h2o_eval import run

    monkeypatch.chdir(tmp_path)
    sweep = ["model=tiny-llama", "task=niah_single_1", "task.length=600", "++task.max_new_tokens=4", "limit=2"]
    sweep += ["batch_size=2", f"data_dir={data_dir}", "results_dir=shared", "wandb.mode=disabled"]
    sweep += ["policy=h2o,knorm", "budget=0.5", "protocol=context"]
    computed, inside, scanned, compute, groups = [], threading.Event(), threading.Event(), run.compute, grid.groups

    def computing(specs, *args):
        computed.append(len(specs))
        inside.set()
        assert scanned.wait(60), "the second grid never looked at the records"
        time.sleep(0.5)  # the second grid reaches the lock while this one holds it
        return compute(specs, *args)

    def grouping(todo):
        if inside.is_set():
            scanned.set()  # the second grid found no records: it will compute them, or wait for them
        return groups(todo)

    monkeypatch.setattr(run, "compute", computing)
    monkeypatch.setattr(grid, "groups", grouping)
    lanes = [threading.Thread(target=grid.main, args=(sweep,)) for _ in range(2)]
    lanes[0].start()
    assert inside.wait(60)
    lanes[1].start()
    for lane in lanes:
        lane.join(120)
    out = capsys.readouterr().out
    assert computed == [2], computed
    assert out.count("2 cells, 0 with records, 2 to compute") == 2
    assert out.count("was written meanwhile") == 2 and out.count("waiting: another process") >= 1
    assert len(list((tmp_path / "shared").glob("*.json"))) == 2


def test_the_grid_refuses_bad_names_in_one_line(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        grid.main(["model=tiny-llama", "task=niah_single_1", "policy=h2o,nope", f"results_dir={tmp_path / 'r'}"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: policy=nope: no policy of that name: use one of adakv")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match="cannot be shared"):
        SharedPrompt([EvictionCache(load_model("tiny-llama")[0], make_policy("h2o", budget=0.5))])


def test_an_invalid_cell_stops_the_grid_before_anything_runs(data_dir, tmp_path, capsys):
    """SnapKV cannot simulate: its two simulate cells are one line each, and the valid cells do not run."""
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=700", "limit=2", f"data_dir={data_dir}"]
    args += ["policy=h2o,snapkv", "budget=0.3,0.5", "protocol=prefill,simulate", f"results_dir={tmp_path / 'r'}"]
    with pytest.raises(SystemExit) as stopped:
        grid.main(args)
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"error: policy=snapkv budget={budget} protocol=simulate: policy 'snapkv' exists only in the prefill and "
        "context protocols: use protocol=prefill"
        for budget in (0.3, 0.5)
    ]
    assert out == "" and not (tmp_path / "r").exists()


def test_the_grid_refuses_a_task_setting_its_task_does_not_take_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        grid.main(["model=tiny-llama", "task=niah_single_1,vt", "+task.num_hops=2", f"results_dir={tmp_path / 'r'}"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: task niah_single_1 takes no num_hops: its settings are ")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("typo", ["budjet=0.5", "+budjet=0.5"])
def test_the_grid_refuses_a_key_the_config_does_not_define_in_one_line(tmp_path, capsys, typo):
    with pytest.raises(SystemExit) as stopped:
        grid.main(["+experiment=kv_leaderboard_quick", "model=tiny-llama", typo, f"results_dir={tmp_path / 'r'}"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error == f"error: {typo}: the config has no setting 'budjet': did you mean budget?"
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_the_grids_wandb_runs_go_under_results_dir_and_nothing_into_the_temporary_folder(data_dir, tmp_path):
    """The grid's W&B offline runs land in ``<results_dir>/wandb/``; the system's temporary folder (``TMPDIR``) is
    left as it was. torch's own compile cache is pointed elsewhere: it is torch's, made on import."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=600", "++task.max_new_tokens=2", "limit=2"]
    args += ["policy=h2o,local", "budget=0.5", "protocol=prefill", f"data_dir={data_dir}", "results_dir=out"]
    args += ["wandb.mode=offline"]
    done = subprocess.run([sys.executable, "-m", "h2o_eval.grid", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb"))) == 2
    assert not list(temporary.iterdir())
    assert "wandb:" not in done.stdout + done.stderr


def test_grid_records_name_the_commit_their_cells_started_from(data_dir, tmp_path, commit_lands_during_the_run):
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=600", "++task.max_new_tokens=2", "limit=2"]
    grid.main(
        [*args, "policy=h2o,local", "budget=0.5", "protocol=prefill", f"data_dir={data_dir}"]
        + [f"results_dir={tmp_path / 'grid'}", "wandb.mode=disabled"]
    )
    records = [json.loads(path.read_text()) for path in (tmp_path / "grid").glob("*.json")]
    assert len(records) == 2 and all(r["git"] == {"commit": "started", "dirty": False} for r in records)


def test_the_leaderboard_preset_sweeps_rulers_tasks_in_kvpress_protocol(data_dir, tmp_path, capsys):
    """``+experiment=kv_leaderboard`` through the grid: its own sweep (13 tasks, every deployable policy, the full
    cache and the oracle, kvpress's four ratios) where the command line narrows nothing, kvpress's protocol (the
    context compressed without the question, kept int(L * (1 - ratio)), nothing evicted afterwards) in every
    record."""
    from h2o_eval.grid import preset_sweep
    from h2o_eval.names import expand

    plain = ["model=tiny-llama", "policy=h2o,local"]
    assert preset_sweep(plain) == plain  # no preset, no sweep of its own
    swept = expand(preset_sweep(["+experiment=kv_leaderboard", "model=tiny-llama"]))
    tasks = {cell[-3].split("=")[1] for cell in swept}
    assert len(swept) == 13 * 16 * 4 and len(tasks) == 13 and "qa_2" in tasks
    args = ["+experiment=kv_leaderboard", "model=tiny-llama", "task=niah_single_1", "task.length=700", "limit=2"]
    args += ["policy=full,snapkv", "budget=0.75,0.25", "++task.max_new_tokens=4", f"data_dir={data_dir}"]
    grid.main([*args, f"results_dir={tmp_path}", "wandb.mode=disabled"])
    assert "3 cells, 0 with records, 3 to compute, 0 refused" in capsys.readouterr().out
    records = [json.loads(path.read_text()) for path in tmp_path.glob("*.json")]
    assert {(r["protocol"], r["config"]["decoding"], r["config"]["rounding"]) for r in records} == {
        ("context", "grow", "down")
    }
    snapkv = {r["budget"]: r["capacity"]["capacity_mean"] for r in records if r["policy"] == "snapkv"}
    context = records[0]["capacity"]["length_mean"]
    assert snapkv[0.25] == pytest.approx(int(0.25 * context), abs=1) and snapkv[0.75] > snapkv[0.25]


@pytest.mark.parametrize(("preset", "questions"), [("kv_leaderboard", 1), ("kv_leaderboard_shared", 4)])
def test_the_leaderboard_presets_name_their_questions_per_context_and_take_16_and_32_to_1(data_dir, preset, questions):
    """kvpress's protocol asks one question per context; the shared-context one four. Both take the ratios 0.9375 and
    0.96875 (budgets 0.0625 and 0.03125), where methods that look alike at 0.875 part, and stack their cells."""
    from h2o_eval.grid import compose

    for budget in (0.0625, 0.03125):
        config = validate(compose([f"+experiment={preset}", "model=smollm2-135m", "task=niah_single_2",
                                   "policy=snapkv", f"budget={budget}", f"data_dir={data_dir}"])).config  # fmt: skip
        assert (config["task"]["questions"], config["budget"], config["protocol"]) == (questions, budget, "context")
        assert (config["decoding"], config["rounding"], config["stack_cells"]) == ("grow", "down", True)


def test_the_grid_takes_as_many_documents_a_batch_as_its_cells_full_caches_fit_in_half_the_memory(
    data_dir, tmp_path, monkeypatch, capsys
):
    """Three cells' full caches of a 600-token document: with memory for 2.5 documents' worth, batches of 1 (half of
    it fits one), said in one line; with plenty, the asked batch_size. The answers are the same either way."""
    from h2o_eval import generation
    from h2o_eval.attention import kv_bytes_per_token

    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 3, "batch_size": 3, "protocol": "context"}
    settings |= {"task.length": 600, "task.max_new_tokens": 4, "decoding": "grow", "budget": 0.5}
    configs = [validate(make_config(data_dir, tmp_path, **settings, policy=p)).config for p in ("full", "h2o", "knorm")]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    per_document = kv_bytes_per_token(model) * 604 * 3
    batches, answer = [], generation.answer
    monkeypatch.setattr(generation, "answer", lambda *a, **k: batches.append(a[4].batch_size) or answer(*a, **k))
    cells = [(configured_policy(c), c) for c in configs]
    monkeypatch.setattr(generation, "available_memory", lambda device: 10**12)
    roomy = RUNNER.evaluate_shared(model, tokenizer, cells)
    monkeypatch.setattr(generation, "available_memory", lambda device: int(2.5 * per_document))
    tight = RUNNER.evaluate_shared(model, tokenizer, cells)
    assert batches == [3, 1]
    assert "batch_size=3 -> 1 documents a batch: 3 cells' full caches take up to" in capsys.readouterr().out
    for one, other in zip(roomy, tight, strict=True):
        assert [o["prediction"] for o in one.outputs] == [o["prediction"] for o in other.outputs]


@pytest.mark.parametrize("stack", [False, True])
def test_a_cells_cpu_time_splits_into_its_prompt_pass_scoring_question_pass_and_decoding(data_dir, tmp_path, stack):
    """Cells sharing a context's pass: each takes a third of it (equal ``prompt`` shares); KVzip's repeat passes are
    its ``scoring``, which costs more than the others' none; every cell feeds its question (``question``) and then
    decodes a token a forward (``decoding``). Under ``prefill`` nothing is a question's pass of its own."""
    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 2, "batch_size": 2, "protocol": "context"}
    settings |= {"task.length": 600, "task.max_new_tokens": 6, "decoding": "grow", "budget": 0.5}
    settings |= {"stack_cells": stack}
    policies = ("full", "kvzip", "knorm")
    configs = [validate(make_config(data_dir, tmp_path, **settings, policy=p)).config for p in policies]
    model, tokenizer = load_model("tiny-llama", device="cpu")
    cells = [(configured_policy(c), c) for c in configs]
    parts = {
        p: e.fields["generation"]["cpu_seconds"]
        for p, e in zip(policies, RUNNER.evaluate_shared(model, tokenizer, cells), strict=True)
    }
    assert len({p["prompt"] for p in parts.values()}) == 1 and parts["full"]["prompt"] > 0
    assert parts["kvzip"]["scoring"] > 10 * max(parts["full"]["scoring"], parts["knorm"]["scoring"])
    assert all(p["question"] > 0 and p["decoding"] > 0 for p in parts.values())
    settings |= {"protocol": "prefill", "stack_cells": False}
    config = validate(make_config(data_dir, tmp_path, **settings, policy="knorm")).config
    alone = RUNNER.evaluate(model, tokenizer, configured_policy(config), config)
    found = alone.fields["generation"]["cpu_seconds"]
    assert found["question"] == 0 and found["prompt"] > 0 and found["decoding"] > 0


class Stopped(BaseException):
    """A run ended from outside (a preempted job, a machine taken back), which nothing in the run catches."""


def test_a_stopped_grid_resumes_from_its_last_batch_and_writes_the_records_an_unstopped_one_would(
    data_dir, tmp_path, monkeypatch, capsys
):
    """Reference: a grid of cells under two protocols (8 batches of one document) run through; implementation: the
    same grid stopped after its 5th batch, then run again with its cells in another order and room for batches of 2,
    into another folder that the stopped run's ``partial/`` was moved to (another machine's checkout of committed
    records). The stopped run writes no record and leaves its answers under ``partial/``, as JSON; the second takes
    them up in their own batches of one, answers only the 3 batches left, says so, writes the records of the
    unstopped run (outputs, scores, capacities, generation fields but time), counts the first run's time, and removes
    the file after the records. A file cut short is started over, with a line that says so."""
    from h2o_eval.generation.partial import Partial

    monkeypatch.chdir(tmp_path)
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=600", "++task.max_new_tokens=6", "limit=4"]
    args += ["batch_size=1", f"data_dir={data_dir}", "wandb.mode=disabled", "budget=0.5"]
    args += ["protocol=context,prefill", "decoding=grow"]
    grid.main([*args, "policy=full,h2o,knorm", "results_dir=whole"])
    saves, save, finish, fitting = [], Partial.save, Partial.finish, generation.fitting_rows

    def stopping(self, *a, **k):
        save(self, *a, **k)
        saves.append(self.path)
        if len(saves) == stop:
            raise Stopped

    def finishing(self):
        assert len(list(self.path.parent.parent.glob("*.json"))) == 6, "the records should be written first"
        finish(self)

    monkeypatch.setattr(Partial, "save", stopping)
    monkeypatch.setattr(Partial, "finish", finishing)
    stop = 5  # the save after which the run stops
    with pytest.raises(Stopped):
        grid.main([*args, "policy=full,h2o,knorm", "results_dir=stopped"])
    assert not list((tmp_path / "stopped").glob("*.json")), "a stopped run should write no record"
    [kept] = (tmp_path / "stopped" / "partial").iterdir()
    assert kept.name == saves[0].name and len(json.loads(kept.read_text())["answers"]) == 6
    (tmp_path / "moved").mkdir()
    (tmp_path / "stopped" / "partial").rename(tmp_path / "moved" / "partial")
    stop = None
    capsys.readouterr()
    monkeypatch.setattr(generation, "fitting_rows", lambda asked, row_bytes, memory: 2)
    grid.main([*args, "policy=knorm,h2o,full", "results_dir=moved"])
    assert len(saves) == 8, "the second run should answer only the 3 batches the first did not"
    resumed = r"answering niah_single_1 x 6 cells: resumed from \S*moved/partial/\w+\.json, 15 of 24 answers kept"
    assert re.search(resumed, capsys.readouterr().err)
    assert not (tmp_path / "moved" / "partial").exists(), "the partial answers should go with the run, their folder too"
    assert not (tmp_path / "whole" / "partial").exists()

    def read(folder):
        records = {}
        for path in sorted((tmp_path / folder).glob("*.json")):
            record = json.loads(path.read_text())
            outputs = [json.loads(line) for line in (tmp_path / folder / record["outputs"]).read_text().splitlines()]
            records[path.name] = record, outputs
        return records

    whole, again = read("whole"), read("moved")
    assert sorted(whole) == sorted(again) and len(whole) == 6
    timing = ("cpu_seconds", "generated_tokens_per_s", "resumed")
    for name, (record, outputs) in whole.items():
        resumed, resumed_outputs = again[name]
        keys = ("id", "prediction", "scores", "capacity", "generated_tokens", "kv_entries")
        assert [[o[k] for k in keys] for o in resumed_outputs] == [[o[k] for k in keys] for o in outputs]
        assert resumed["metrics"] == record["metrics"] and resumed["capacity"] == record["capacity"]
        generated = {k: v for k, v in resumed["generation"].items() if k not in timing}
        assert generated == {k: v for k, v in record["generation"].items() if k not in timing}
        assert "resumed" not in record["generation"]
        earlier = resumed["generation"]["resumed"]
        assert earlier["answers"] == (4 if "context" in name else 1) and earlier["git"] == resumed["git"]
        assert resumed["cpu_seconds"] > earlier["cpu_seconds"] > 0
        assert resumed["wall_seconds"] > earlier["wall_seconds"] > 0

    stop = len(saves) + 5
    monkeypatch.setattr(generation, "fitting_rows", fitting)
    with pytest.raises(Stopped):
        grid.main([*args, "policy=full,h2o,knorm", "results_dir=cut"])
    [kept] = (tmp_path / "cut" / "partial").iterdir()
    kept.write_bytes(kept.read_bytes()[:100])
    stop = None
    capsys.readouterr()
    grid.main([*args, "policy=full,h2o,knorm", "results_dir=cut"])
    assert f"partial answers {kept} unreadable" in capsys.readouterr().err
    assert len(saves) == 8 + 5 + 8 and sorted(read("cut")) == sorted(whole)


def test_answers_kept_on_another_device_or_thread_count_or_as_a_pickle_are_started_over(tmp_path, capsys):
    """device=auto and an unset thread count resolve differently on different machines, and either may change an
    answer's rounding: a run takes up the answers of a stopped run made as it is made, and starts over, in one line,
    those made on another device or with other threads, and a file an older h2o_eval pickled (never unpickled: it
    could run code), which it removes."""
    from h2o_eval.generation.partial import Partial

    path, names, cpu = tmp_path / "partial" / "a.json", ["r1.json", "r2.json"], {"device": "cpu", "threads": 1}

    def kept(made):
        Partial(path, names, made=cpu).save(1, {("context", 0)}, [["a"], ["b"]])
        return Partial(path, list(reversed(names)), made=made).load(1)

    earlier = kept(dict(cpu))
    assert earlier.answers == [["b"], ["a"]] and earlier.batches == {("context", 0)}
    assert capsys.readouterr().err == ""
    assert kept({"device": "cuda:0", "threads": 1}) is None
    assert kept({"device": "cpu", "threads": 2}) is None
    pickled = path.with_suffix(".pkl")
    pickled.write_bytes(b"not to be unpickled")
    path.unlink()
    assert Partial(path, names, made=cpu).load(1) is None and not pickled.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"partial answers {path} answered with cpu, 1 thread, and this run has cuda:0, 1 thread: starting over",
        f"partial answers {path} answered with cpu, 1 thread, and this run has cpu, 2 threads: starting over",
        f"partial answers {pickled} kept by an older h2o_eval: starting over",
    ]


def test_a_config_groups_files_are_read_once_and_each_caller_gets_its_own_copy(monkeypatch):
    """A grid checks every cell's names against the config groups: the YAML files are parsed at the first call
    only, and a caller that changes what it got changes nothing the next caller gets."""
    import yaml

    import h2o_eval.conf as conf

    conf._read.cache_clear()
    parsed = []
    monkeypatch.setattr(yaml, "safe_load", lambda text, load=yaml.safe_load: parsed.append(1) or load(text))
    first = conf.options("policy")
    count = len(parsed)
    first["h2o"]["budget"] = "changed"
    again = conf.options("policy")
    assert count > 1 and len(parsed) == count
    assert again["h2o"] != first["h2o"] and again == conf._read("policy")
