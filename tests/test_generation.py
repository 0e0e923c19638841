"""Summarisation under real eviction: prompts, decoding equivalences, batching, and the ROUGE in the record."""

from __future__ import annotations

import gc
import re
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from conftest import FAST_POLICIES, fast_sample, registered

from h2o_eval import EvictionCache, compress, load_model, make_policy
from h2o_eval.generation import Batch, complete, generate, make_batch, settle
from h2o_eval.policies import POLICIES, Policy, example_policy


def encode(tokenizer, parts, protocol):
    """(context, question) texts as the summarisation runner tokenizes them: apart under ``context``, whole else."""
    if protocol == "context":
        contexts = [tokenizer(c).input_ids for c, _ in parts]
        questions = [tokenizer(q, add_special_tokens=False).input_ids for _, q in parts]
    else:
        contexts, questions = [tokenizer(c + q).input_ids for c, q in parts], [[] for _ in parts]
    return make_batch(contexts, questions, tokenizer.pad_token_id, "cpu", split=protocol == "context")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-llama", device="cpu")
    tokenizer.padding_side = "left"
    return model, tokenizer


def prompts_batch(tokenizer):
    texts = [
        "###\nArticle: The council met on Tuesday to discuss the new bridge over the river.\n\nSummarize",
        "###\nArticle: Rain.\n\nSummarize",
        "###\nArticle: A longer story about heavy hitters in caches.",
    ]
    return tokenizer(texts, return_tensors="pt", padding=True)


@torch.no_grad()
def test_full_policy_generates_exactly_what_plain_generate_does(tiny):
    model, tokenizer = tiny
    batch = prompts_batch(tokenizer)
    plain = model.generate(**batch, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for protocol in ("prefill", "simulate"):
        cache = EvictionCache(model, make_policy("full"), protocol=protocol)
        full = model.generate(
            **batch, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id, cache=cache
        )
        assert torch.equal(full, plain)


@torch.no_grad()
@pytest.mark.parametrize("protocol", ["prefill", "context"])
def test_a_finished_cache_is_freed_without_the_garbage_collector(tiny, protocol):
    """A runner makes one cache per batch (34 per batch in a long-context grid): each must be freed when its last
    reference goes, not left in a reference cycle until a full collection (a 4k grid grew 1 GB per batch)."""
    model, tokenizer = tiny
    batch = prompts_batch(tokenizer)
    width = batch["input_ids"].shape[1] - 3 if protocol == "context" else None
    gc.disable()
    try:
        cache = EvictionCache(model, make_policy("h2o", budget=0.5), protocol=protocol)
        complete(model, cache, Batch(batch["input_ids"], batch["attention_mask"], width), tokenizer, max_new_tokens=4)
        held = [weakref.ref(cache), *(weakref.ref(layer.keys) for layer in cache.layers)]
        del cache
        assert [ref() for ref in held] == [None] * len(held)
    finally:
        gc.enable()


@torch.no_grad()
@pytest.mark.parametrize(
    ("name", "protocol"),
    fast_sample(
        [
            (name, protocol)
            for name in registered("prefill", evicting=True)
            for protocol in ("prefill", "simulate")
            if protocol in POLICIES[name].protocols
        ],
        lambda case: case[0] in ("full", "h2o", "snapkv", "kvzip"),
    ),
)
def test_a_budget_covering_prompt_and_output_changes_nothing(tiny, name, protocol):
    """Policies that evict hold 4 entries at most; those that grow after their prompt hold what they kept (4, or
    PyramidKV's lowest layer's share) plus every generated token."""
    model, tokenizer = tiny
    batch = prompts_batch(tokenizer)
    greedy = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    plain = model.generate(**batch, **greedy)
    prompts = Batch(batch.input_ids, batch.attention_mask)
    cache = EvictionCache(model, example_policy(name, batch.input_ids.shape[1] + 16), protocol=protocol)
    evicting = complete(model, cache, prompts, tokenizer, **greedy)
    assert torch.equal(evicting, plain)
    small = EvictionCache(model, example_policy(name, 4), protocol=protocol)
    squeezed = complete(model, small, prompts, tokenizer, **greedy)
    assert not torch.equal(squeezed, plain), "a 4-token cache changed nothing: the test proves nothing"
    policy = example_policy(name, 4)
    most = max(policy.plan(int(n), layer, 2).capacity for n in batch.attention_mask.sum(-1) for layer in range(2))
    if policy.rule.safeguard is not None:  # one KV head may take the layer's 2 x 4 slots but the other's window
        assert most + 15 <= small.peak_entries <= 2 * 4 - policy.plan(4).recent + 15
    elif policy.rehearses:  # its extra passes (the oracle's: the answer) are held for a moment, then dropped
        held = max(int(layer.held.sum(-1).max()) for layer in small.layers)
        assert held == most + 15 <= small.peak_entries
    else:
        assert small.peak_entries == (most + 15 if policy.rule.grows else 4)  # the last token is never fed


@torch.no_grad()
@pytest.mark.parametrize("name", ["full", "snapkv", "adakv", "keydiff"])
def test_a_cache_that_cannot_evict_appends_decode_steps_in_place_as_one_chunk_would(tiny, name):
    """Reference: the tokens a cache generated step by step, fed after the same prompt as one chunk (attention over
    the held slots and the chunk's own tokens, causally); implementation: decode steps of a cache that can no longer
    evict (full; snapkv and adakv, whose heads hold different counts, and keydiff, which rescores its prompt, after
    their prompt), each writing its token into spare room at the end of the layer's buffers, so that the slots
    never move (no copy of the cache)."""
    model, tokenizer = tiny
    batch = prompts_batch(tokenizer)
    params = {"window": 2} if name == "snapkv" else {}

    def prefilled():
        cache = EvictionCache(model, make_policy(name, budget=4, **params), protocol="prefill")
        logits = model(**batch, cache=cache, use_cache=True).logits[:, -1:]
        return cache, logits

    cache, logits = prefilled()
    tokens, steps, storage = [], [], []
    mask = batch.attention_mask
    for _ in range(6):
        tokens.append(logits.argmax(-1))
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], -1)
        logits = model(tokens[-1], attention_mask=mask, cache=cache, use_cache=True).logits
        steps.append(logits)
        storage.append(cache.layers[0].keys.data_ptr())
    assert len(set(storage)) == 1
    chunk_cache, _ = prefilled()
    chunk = model(torch.cat(tokens, -1), attention_mask=mask, cache=chunk_cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat(steps, 1), chunk, rtol=1e-5, atol=1e-5)
    for layer, other in zip(cache.layers, chunk_cache.layers, strict=True):
        width = other.held.shape[-1]  # the rest is the decoding cache's spare room, empty
        assert torch.equal(layer.held[..., :width], other.held) and not layer.held[..., width:].any()


@torch.no_grad()
@pytest.mark.parametrize("name", fast_sample(registered("context", evicting=True), lambda name: name in FAST_POLICIES))
def test_context_protocol_equals_compressing_the_context_then_feeding_the_question_token_by_token(tiny, name):
    """Reference: an EvictionCache(protocol="context") fed each document's context alone as one chunk, then its
    question one token at a time, then greedy decoding one token at a time; implementation: the runner's
    generation path (make_batch + generate), a left-padded batch whose contexts are compressed before generate()
    feeds the questions. Budget 0.3 of each context."""
    model, tokenizer = tiny
    question = "\n\nSummarize the above article in 1 sentence.\n"
    parts = [
        ("###\nArticle: The council met on Tuesday to discuss the new bridge over the river and its cost.", question),
        ("###\nArticle: Rain fell all week.", question),
    ]
    policy = example_policy(name, 0.3)
    batch = encode(tokenizer, parts, "context")
    ids, mask = batch.input_ids, batch.attention_mask
    batched, _ = generate(
        model, policy, batch, tokenizer, protocol="context", kernels="auto", max_new_tokens=6, do_sample=False,
        pad_token_id=0,
    )  # fmt: skip
    for row, (context, text) in enumerate(parts):
        alone = EvictionCache(model, policy, protocol="context")
        context_ids = torch.tensor([tokenizer(context).input_ids])
        question_ids = tokenizer(text, add_special_tokens=False).input_ids
        logits = model(context_ids, cache=alone, use_cache=True).logits
        settle(model, alone, tokenizer, context_ids, torch.ones_like(context_ids), [question_ids], max_new_tokens=6,
               do_sample=False, pad_token_id=0)  # fmt: skip
        for token in question_ids:
            logits = model(torch.tensor([[token]]), cache=alone, use_cache=True).logits
        generated = []
        for _ in range(6):
            generated.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([generated[-1:]]), cache=alone, use_cache=True).logits
        assert batched[row, ids.shape[1] :].tolist() == generated
        length = context_ids.shape[1]
        if type(getattr(policy, "base", policy)).allocate is Policy.allocate:
            assert alone.capacity().item() == policy.capacity(length)
        else:  # KVzip's model-wide selection: kvpress's int(N (1 - budget)) of all N pairs go, layers' shares differ
            units = alone.layers[0].held.shape[1] * len(alone.layers)
            kept = length * units - int(length * units * (1 - policy.budget))
            assert alone.capacity().item() == pytest.approx(kept / units)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert not torch.equal(batched, plain), "compression changed nothing: the test proves nothing"


@torch.no_grad()
def test_context_protocol_with_an_empty_question_is_prefill(tiny):
    model, tokenizer = tiny
    parts = [("###\nArticle: The council met on Tuesday to discuss the new bridge.", ""), ("###\nArticle: Rain.", "")]
    outputs = {}
    for protocol in ("prefill", "context"):
        batch = encode(tokenizer, parts, protocol)
        outputs[protocol], _ = generate(
            model,
            make_policy("h2o", budget=0.3),
            batch,
            tokenizer,
            protocol=protocol,
            kernels="auto",
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    assert torch.equal(outputs["prefill"], outputs["context"])


def test_context_batches_need_questions_of_one_length(tiny):
    _, tokenizer = tiny
    with pytest.raises(ValueError, match="questions of one length"):
        encode(tokenizer, [("A.", "Why?"), ("B.", "Why on earth would it?")], "context")


def test_kvzip_through_the_public_api_holds_c_slots_once_compress_ran(tiny):
    """docs/python-api.md's path: feed the context through an EvictionCache, call ``cache.compress``: KVzip's passes run
    and the cache holds C of the context's tokens per layer and KV head (KVzip shares the model's C x layers x
    heads slots out across them), as the runners' own path (``settle``) leaves it."""
    model, tokenizer = tiny
    context = torch.randint(5, 400, (1, 120))
    cache = EvictionCache(model, make_policy("kvzip", budget=30), protocol="context")
    model(context, cache=cache, use_cache=True)
    assert [int(layer.held.sum(-1).max()) for layer in cache.layers] == [120, 120]  # whole until the passes ran
    compress(model, cache, tokenizer, context)
    assert sum(int(layer.held.sum()) for layer in cache.layers) == 30 * 2 * 2
    assert cache.capacity().tolist() == [30.0]
    runner = EvictionCache(model, make_policy("kvzip", budget=30), protocol="context")
    model(context, cache=runner, use_cache=True)
    settle(model, runner, tokenizer, context, torch.ones_like(context), [[]])
    for mine, theirs in zip(cache.layers, runner.layers, strict=True):
        assert torch.equal(mine.held, theirs.held) and torch.equal(mine.keys, theirs.keys)
    held = [layer.held.sum(-1) for layer in cache.layers]
    model(torch.randint(5, 400, (1, 4)), cache=cache, use_cache=True)  # the question follows the compressed context
    assert all(torch.equal(layer.held.sum(-1), before + 4) for layer, before in zip(cache.layers, held, strict=True))


def test_per_head_budgets_allocate_the_bytes_their_capacity_says(tiny):
    """KVzip, Ada-KV and CriticalKV at budget 0.25 on SmolLM2, after their compression: the keys and values the
    cache allocates are at most 0.27 of the full cache's, where heads padded to the fullest took up to 0.42 (a
    ragged layout: each head's rows are what it holds). KVzip's heads hold different counts here, so the ragged
    layout is what is measured."""
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    context = tokenizer("Paris is the capital of France. " * 12, return_tensors="pt").input_ids
    full = EvictionCache(model, make_policy("full"), protocol="context")
    model(context, cache=full, use_cache=True)
    for name in ("kvzip", "adakv", "criticalkv"):
        cache = EvictionCache(model, make_policy(name, budget=0.25), protocol="context")
        model(context, cache=cache, use_cache=True)
        compress(model, cache, tokenizer, context)
        assert cache.kv_bytes() <= 0.27 * full.kv_bytes(), name
        if name == "kvzip":
            assert any(layer.slots.entry is not None for layer in cache.layers)


def test_a_ragged_layer_decodes_as_the_chunk_path_would(tiny):
    """Reference: the generated tokens fed as one chunk after the same compressed context (the mechanism's chunk
    path, on the dense layout); implementation: 60 decode steps into KVzip's ragged layout, which crosses its
    first bucket of room (a regrowth): the same logits, the same held slots."""
    model, tokenizer = tiny
    context = torch.randint(5, 400, (1, 120), generator=torch.Generator().manual_seed(11))

    def compressed():
        cache = EvictionCache(model, make_policy("kvzip", budget=30), protocol="context", decoding="grow")
        model(context, cache=cache, use_cache=True)
        compress(model, cache, tokenizer, context)
        return cache

    cache = compressed()
    assert all(layer.slots.entry is not None for layer in cache.layers), "the heads should hold different counts"
    tokens = torch.randint(5, 400, (1, 60), generator=torch.Generator().manual_seed(12))
    steps = [model(tokens[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(tokens.shape[1])]
    chunk_cache = compressed()
    chunk = model(tokens, cache=chunk_cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat(steps, 1), chunk, rtol=1e-5, atol=1e-5)
    for layer, other in zip(cache.layers, chunk_cache.layers, strict=True):
        assert torch.equal(layer.held.sum(-1), other.held.sum(-1))
        mine = [sorted(layer.position[0, h][layer.held[0, h]].tolist()) for h in range(layer.held.shape[1])]
        theirs = [sorted(other.position[0, h][other.held[0, h]].tolist()) for h in range(other.held.shape[1])]
        assert mine == theirs


@pytest.mark.parametrize("name", [n for n in POLICIES if example_policy(n).rehearses])
def test_a_prompt_waiting_for_its_passes_refuses_the_next_tokens_naming_compress(tiny, name):
    model, tokenizer = tiny
    cache = EvictionCache(model, example_policy(name), protocol="context")
    model(torch.randint(5, 400, (1, 40)), cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match=r"call h2o_eval\.compress\(model, cache, tokenizer, input_ids\)"):
        model(torch.randint(5, 400, (1, 1)), cache=cache, use_cache=True)


def test_compress_leaves_a_policy_without_passes_as_it_compressed_itself(tiny):
    model, tokenizer = tiny
    context = torch.randint(5, 400, (1, 60))
    cache = EvictionCache(model, make_policy("snapkv", budget=20), protocol="context")
    model(context, cache=cache, use_cache=True)
    held = [layer.held.clone() for layer in cache.layers]
    compress(model, cache, tokenizer, context)
    assert all(torch.equal(before, layer.held) for before, layer in zip(held, cache.layers, strict=True))


def test_min_new_tokens_in_the_prefill_protocol_gives_that_many_tokens_without_a_length_warning(tiny):
    """KVzip's prefill generates the first token from the prompt's forward, then the rest: each part is asked
    for what is left of ``min_new_tokens``, never more than its ``max_new_tokens`` (transformers warns that such
    a request is unfeasible), and the sequences still hold ``min_new_tokens`` new tokens."""
    import warnings

    model, tokenizer = tiny
    ids = torch.randint(1000, 40000, (2, 40), generator=torch.Generator().manual_seed(0))
    settings = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sequences, _ = generate(
            model, make_policy("kvzip", budget=16), Batch(ids, torch.ones_like(ids)), tokenizer, protocol="prefill",
            kernels="torch", **settings,
        )  # fmt: skip
    assert sequences.shape == (2, 46)
    assert not [w for w in caught if "length" in str(w.message).lower()], [str(w.message) for w in caught]


def _random_documents(count: int, seed: int) -> list:
    """``count`` documents of 30 random tokens, each with 2 questions of 3."""
    from h2o_eval.generation.answering import Document

    generator = torch.Generator().manual_seed(seed)
    return [
        Document(torch.randint(5, 400, (30,), generator=generator).tolist(),
                 [torch.randint(5, 400, (3,), generator=generator).tolist() for _ in range(2)])
        for _ in range(count)
    ]  # fmt: skip


def test_answering_counts_each_cells_answers_as_they_come_and_redraws_between_them(tiny, monkeypatch):
    """One batch of 3 documents of 2 questions, 3 cells: the bar counts each cell's answers as that cell finishes
    (6 at a time, up to 18), not the batch's at its end, shows what it does now, and redraws itself between units
    (here every 10 ms), so that a long prompt pass still shows the run alive."""
    from h2o_eval.generation import log
    from h2o_eval.generation.answering import Cell, Settings, answer
    from h2o_eval.policies import example_policy

    model, tokenizer = tiny
    seen, redraws, phases = [], [], []
    progress = log.Progress

    class Watched(progress):
        def __init__(self, total, description, unit):
            super().__init__(total, description, unit, every=0.01)
            seen.append(("total", total))
            original = self.bar.refresh
            self.bar.refresh = lambda *a, **k: redraws.append(1) or original(*a, **k)

        def update(self, count, ends_batch=True):
            seen.append(count)
            time.sleep(0.05)
            super().update(count, ends_batch)

        def phase(self, text):
            phases.append(text)
            super().phase(text)

    monkeypatch.setattr("h2o_eval.generation.answering.Progress", Watched)
    documents = _random_documents(3, seed=1)
    cells = [Cell(example_policy(name, 0.5), "context") for name in ("full", "h2o", "knorm")]
    answer(model, tokenizer, cells, documents, Settings(3, batch_size=3))
    assert seen == [("total", 18), 3, 3, 3, 3, 3, 3]  # a cell answers one question group of 3 rows at a time
    assert phases[0] == "documents 1-3: contexts" and len(redraws) >= 5


@pytest.mark.parametrize("stack", [False, True])
def test_answering_says_the_time_left_once_after_its_first_batch_not_its_first_answers(tiny, capsys, stack):
    """A grid's cells answer a batch one after another, after its shared context pass: the time left is said once,
    after the first batch's answers from every cell (3 cells x 2 documents x 2 questions: 12 of 24), so the shared
    pass is spread over them all, not charged to the first cell's first 2 answers (an estimate 6x too long)."""
    from h2o_eval.generation.answering import Cell, Settings, answer
    from h2o_eval.policies import example_policy

    model, tokenizer = tiny
    documents = _random_documents(4, seed=2)
    cells = [Cell(example_policy(name, 0.5), "context") for name in ("full", "h2o", "knorm")]
    answer(model, tokenizer, cells, documents, Settings(3, batch_size=2, decoding="grow", stack=stack))
    told = [line for line in capsys.readouterr().err.splitlines() if "min left" in line]
    assert len(told) == 1 and re.fullmatch(r"answering: ~\d+ min left \(12 of 24 answers in \d+ s\)", told[0]), told


def test_answering_that_fails_stops_its_progress_bar_redrawing(tiny, monkeypatch):
    """A run that raises (here in its contexts' pass) closes its bar: the thread redrawing it has ended when the error
    reaches the caller, so a sweep's next job does not go on redrawing a dead bar."""
    from h2o_eval.generation import answering, log
    from h2o_eval.generation.answering import Cell, Document, Settings, answer
    from h2o_eval.policies import example_policy

    model, tokenizer = tiny
    bars = []

    class Watched(log.Progress):
        def __init__(self, *args):
            super().__init__(*args, every=0.01)
            bars.append(self)

    def fails(self, members):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(answering, "Progress", Watched)
    monkeypatch.setattr(answering._Answering, "contexts", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        answer(model, tokenizer, [Cell(example_policy("h2o", 0.5), "context")], [Document([5, 6, 7], [[8]])],
               Settings(3, batch_size=1))  # fmt: skip
    assert len(bars) == 1 and not bars[0].redraws.is_alive()


@pytest.mark.parametrize(
    ("name", "budget", "protocol"),
    [("h2o", 12, "prefill"), ("tova", 0.5, "context"), ("kvzip", 0.5, "prefill"), ("streaming", 10, "prefill")],
)
def test_rows_leaving_their_batch_generate_what_each_generates_alone_and_log_their_own_cache(
    tiny, monkeypatch, name, budget, protocol
):
    """Reference: each prompt generated alone (batch 1, its cache at its own end); implementation: the batch through
    ``run_batch(leaving=True)``, each row leaving as its answer ends (an end-of-sequence token the rows generate at
    different steps). The same tokens, kept entries and capacities per row, and ``generate`` called again as rows
    left; carried to the end instead (``leaving=False``), the same tokens."""
    from h2o_eval import generation
    from h2o_eval.generation import GenerationLog, run_batch

    model, tokenizer = tiny
    generator = torch.Generator().manual_seed(11)
    contexts = [torch.randint(5, 500, (n,), generator=generator).tolist() for n in (30, 41, 36)]
    questions = [torch.randint(5, 500, (4,), generator=generator).tolist() for _ in contexts]
    batch = make_batch(contexts, questions, tokenizer.pad_token_id, "cpu", split=protocol == "context")
    settings = {"max_new_tokens": 14, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}

    def alone(row):
        one = make_batch([contexts[row]], [questions[row]], tokenizer.pad_token_id, "cpu", split=protocol == "context")
        log = GenerationLog(max_new_tokens=14)
        policy = make_policy(name, budget=budget)
        return run_batch(model, policy, one, log, tokenizer, protocol=protocol, kernels="torch", **settings)[0]

    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    free = [alone(row)["tokens"] for row in range(3)]

    def end_steps(ends):  # the step at which each row first generates one of ``ends`` (None: never)
        return [next((step for step, token in enumerate(tokens) if token in ends), None) for tokens in free]

    # end tokens: one of row 0's and one of row 1's, at which the rows end at three different steps (one never)
    ends = next(
        {free[0][a], free[1][b]}
        for a in range(2, 12)
        for b in range(a + 2, 13)
        if len(set(end_steps({free[0][a], free[1][b]}))) == 3
    )
    monkeypatch.setattr(model.generation_config, "eos_token_id", sorted(ends))
    with ending_at(tokenizer, min(ends)):
        expected = [alone(row) for row in range(3)]
        calls, decode = [], generation.passes.decode
        monkeypatch.setattr(generation.passes, "decode", lambda *a, **k: calls.append(a[2].shape[0]) or decode(*a, **k))
        log = GenerationLog(max_new_tokens=14)
        policy = make_policy(name, budget=budget)
        rows = run_batch(model, policy, batch, log, tokenizer, protocol=protocol, kernels="torch", leaving=True,
                         **settings)  # fmt: skip
        carried = run_batch(model, make_policy(name, budget=budget), batch, GenerationLog(14), tokenizer,
                            protocol=protocol, kernels="torch", **settings)  # fmt: skip
    for got, want in zip(rows, expected, strict=True):
        assert got == want
    assert len(calls) >= 2 and calls[-1] < 3
    assert log.rows == 3 and log.generated_tokens == sum(len(row["tokens"]) for row in expected)
    assert [row["tokens"] for row in carried] == [row["tokens"] for row in expected]


@contextmanager
def ending_at(tokenizer, token: int) -> Iterator[None]:
    """``tokenizer``'s end-of-sequence token is ``token`` inside the block, and its own again after. Not
    ``monkeypatch``: transformers 5 keeps special tokens in a map behind ``__setattr__``, so pytest 9.2's undo,
    finding no instance attribute to restore, deletes one that is not there."""
    before = tokenizer.eos_token_id
    tokenizer.eos_token_id = token
    try:
        yield
    finally:
        tokenizer.eos_token_id = before


def test_a_regrowth_lays_out_what_a_fresh_ragged_layout_of_the_same_tokens_does():
    """Reference: :func:`ragged` of a layout that took 5 tokens per head (the dense layout gathered, held slots
    sorted first); implementation: :func:`regrown`, which moves each held row to its new place. Two sequences of 3
    KV heads holding different counts: the same slots, positions, scores and entries, the same keys and values in
    every held slot."""
    from h2o_eval.decode import FREE, Slots, append_ragged, ragged, regrown, rows_at

    gen = torch.Generator().manual_seed(4)
    batch, kv_heads, width, dim = 2, 3, 12, 4
    counts = [[3, 7, 12], [5, 1, 9]]
    held = torch.arange(width) < torch.tensor(counts).unsqueeze(-1)
    slots = Slots(
        torch.randn(batch, kv_heads, width, dim, generator=gen),
        torch.randn(batch, kv_heads, width, dim, generator=gen),
        held,
        torch.where(held, torch.arange(width).expand(batch, kv_heads, -1), FREE),
        torch.randn(batch, kv_heads, width, generator=gen).masked_fill(~held, -torch.inf),
    )
    laid = ragged(slots, 5, counts)
    count = torch.tensor(counts)
    for step in range(5):
        key, value = (torch.randn(batch, kv_heads, 1, dim, generator=gen) for _ in range(2))
        now = torch.full((batch, 1, 1), 20 + step)
        append_ragged(laid, key, value, now, count, torch.randn(batch, kv_heads, 1, generator=gen))
    grown = [[c + 5 for c in row] for row in counts]
    expected, found = ragged(laid, 7, grown), regrown(laid, 7, grown)
    for name in ("held", "position", "scores", "entry"):
        assert torch.equal(getattr(found, name), getattr(expected, name)), name
    for name in ("keys", "values"):
        mine, theirs = (rows_at(getattr(s, name), s.entry) for s in (found, expected))
        assert torch.equal(mine[expected.held], theirs[expected.held]), name
