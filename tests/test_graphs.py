"""Decode steps as CUDA graphs (h2o_eval.graphs), proven on the CPU: :class:`RecordedGraph` replays a captured step's
aten operations with a CUDA graph's semantics (the host's code is not run again, tensors made during the capture are
reused), so a step that depended on anything but its static buffers would replay wrong. Reference: eager decoding;
implementation: the same generation with every capturable step captured once per set of buffers and replayed."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from conftest import FAST_POLICIES, fast_sample, make_config, registered
from test_backend import SMALL, random_model

from h2o_eval import EvictionCache, load_model, make_policy
from h2o_eval.benchmarks.decode_ops import count
from h2o_eval.errors import ConfigError
from h2o_eval.generation import Batch, complete, greedy
from h2o_eval.generation.answering import Cell, Document, Settings, answer
from h2o_eval.generation.log import GenerationLog
from h2o_eval.graphs import Capturable, RecordedGraph
from h2o_eval.interval import Intervals
from h2o_eval.layer import EvictionLayer
from h2o_eval.layouts import Bounded, DecodeLayout, Dense
from h2o_eval.policies import Interval, configured_policy, example_policy
from h2o_eval.run import validate
from h2o_eval.runners import runner_of

STEPS = 30  # past a growing cache's first bucket (64 slots for a 40-token prompt)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", device="cpu")


def decoded(model, tokenizer, name: str, decoding: str, graphs: bool):
    """``STEPS`` greedy tokens after a left-padded 40-token prompt (compressed after a policy's extra passes, on the
    one generation path), and the cache."""
    ids = torch.randint(5, 400, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    cache = EvictionCache(
        model, example_policy(name, 0.5), protocol="prefill", decoding=decoding, graphs="emulate" if graphs else False
    )
    settings = greedy(STEPS, tokenizer.pad_token_id, min_new_tokens=STEPS)
    sequences = complete(model, cache, Batch(ids, mask), tokenizer, **settings)
    cache.check_faults()
    return sequences, cache


@pytest.mark.parametrize(
    ("name", "decoding"),
    fast_sample(
        [(name, decoding) for name in registered("prefill") for decoding in ("evict", "grow")],
        lambda case: case in (("h2o", "evict"), ("full", "grow"), ("random", "evict")),
    ),
)
def test_replayed_decode_steps_equal_eager_ones(tiny, name, decoding, monkeypatch):
    """Every cache-holding policy under both decoding rules: the same tokens, held slots and positions, and scores
    within float rounding; all but the warm-up steps of each set of buffers are replays. Position scores are made
    8 positions ahead, so that their table is made anew between replays too."""
    monkeypatch.setattr("h2o_eval.layouts.AHEAD", 8)
    model, tokenizer = tiny
    eager, expected = decoded(model, tokenizer, name, decoding, graphs=False)
    replayed, cache = decoded(model, tokenizer, name, decoding, graphs=True)
    assert torch.equal(replayed, eager)
    for layer, reference in zip(cache.layers, expected.layers, strict=True):
        assert torch.equal(layer.held, reference.held)
        held = layer.held
        assert torch.equal(layer.position[held], reference.position[held])
        torch.testing.assert_close(layer.scores[held], reference.scores[held], rtol=1e-5, atol=1e-6)
    assert cache.graphs.replays >= STEPS - 6


def test_a_replay_runs_no_host_code_so_a_step_that_reads_a_host_count_replays_stale():
    """The recorded graph is as strict as a CUDA graph: a step that writes at an index kept on the host writes to
    the captured index on every replay, so a test of replay against eager decoding would catch it."""
    buffer = torch.zeros(4)
    index = {"at": 0}

    def step():
        buffer[index["at"]] += 1
        index["at"] += 1

    graph = RecordedGraph()
    graph.capture(step, lambda: [buffer])
    graph.replay(lambda: [buffer])  # the capture's own run
    graph.replay(lambda: [buffer])
    graph.replay(lambda: [buffer])
    assert buffer.tolist() == [3.0, 0.0, 0.0, 0.0]  # eagerly it would be [1, 1, 1, 0]


def test_a_captured_step_that_reads_a_value_on_the_host_is_refused():
    values = torch.arange(4.0)
    with pytest.raises(RuntimeError, match="reads a tensor's value on the host"):
        RecordedGraph().capture(lambda: values[int(values.argmax())], lambda: [values])


def test_graphs_apply_on_cuda_only(tiny):
    """On by default, they capture nothing on the CPU (no CUDA graphs there) and nothing for a one-forward cache."""
    model, _ = tiny
    assert EvictionCache(model, example_policy("h2o")).graphs is None


def test_decode_steps_of_a_bounded_cache_keep_their_buffers(tiny):
    """An evicting cache decodes into the buffers its prompt's compression left: no step allocates state, so one
    captured step serves every later one."""
    model, tokenizer = tiny
    ids = torch.randint(5, 400, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = EvictionCache(model, example_policy("h2o", 0.25), protocol="prefill")
    model(ids, cache=cache, use_cache=True)
    before = cache.buffers()
    token = ids[:, -1:]
    for step in range(12):
        model(token, position_ids=torch.tensor([[40 + step]]), cache=cache, use_cache=True)
        cache.prepare_decode()
        if step:
            assert cache.buffers() == before
        before = cache.buffers()


@pytest.mark.parametrize(
    ("name", "decoding", "kind"), [("h2o", "evict", Bounded), ("full", "grow", Dense), ("knorm", "interval", Intervals)]
)
def test_a_decode_layout_owns_the_state_and_its_step_touches_nothing_of_the_layer(tiny, name, decoding, kind):
    """After the prompt each layer's state is its layout's (a DecodeLayout), and the cache is what the graphs drive
    (Capturable). A layout's host work and step, run by hand, leave every attribute of its layer as it was: the step
    reads what it bound when it was made and writes its own slots only. Under ``decoding=interval`` the layout the
    layer settled in is wrapped (Intervals), and only a layer of another decoding records nothing."""
    model, _ = tiny
    ids = torch.randint(5, 400, (1, 40), generator=torch.Generator().manual_seed(4))
    interval = Interval(8, target_size=32) if decoding == "interval" else None
    cache = EvictionCache(model, example_policy(name, 0.25), protocol="prefill", decoding=decoding, interval=interval)
    model(ids, cache=cache, use_cache=True)
    assert isinstance(cache, Capturable)
    config = model.config
    kv_heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, config.num_attention_heads, 1, dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, 1, dim, generator=generator) for _ in range(2))
    for layer in cache.layers:
        layout = layer.layout
        assert isinstance(layout, kind) and isinstance(layout, DecodeLayout)
        assert layer.slots is layout.slots and layer._slots is None
        assert bool(layer.recorders) == (decoding == "interval")
        before = dict(vars(layer))
        layout.prepare()
        output = layout.step(query, key, value)
        assert output.shape == query.shape and torch.isfinite(output).all()
        assert vars(layer).keys() == before.keys()
        assert all(vars(layer)[name] is value for name, value in before.items())


@pytest.mark.parametrize(
    ("name", "decoding"),
    fast_sample(
        [(name, decoding) for name in registered("prefill") for decoding in ("evict", "grow")],
        lambda case: case[0] in FAST_POLICIES[:3],
    ),
)
def test_an_eviction_cache_adds_at_most_sixteen_operations_per_layer_to_a_decode_step(name, decoding):
    """Reference: plain transformers' decode step (a DynamicCache, SDPA); implementation: the same step through an
    EvictionCache, 16 steps after a 96-token prompt. Counted as computing aten operations per layer and step, each a
    kernel launch on a GPU (benchmarks.decode_ops). The step runs in at most 7 of the project's files: the hook,
    the cache and its layer, the sequences, the layout, its slots' operations and the kernel (a layout binds its
    kernel and scorer, and a layer under another decoding than interval has no interval counts to move)."""
    model, tokenizer = load_model("tiny-llama3", device="cpu")
    layers, steps = model.config.num_hidden_layers, 16
    plain = count(model, tokenizer, None, "evict", 96, steps, 0.25).total
    ops = count(model, tokenizer, name, decoding, 96, steps, 0.25)
    assert (ops.total - plain) / layers / steps <= 16
    assert len(ops.files) <= 7, sorted(ops.files)


def decode_steps(model, cache, ids, steps):
    """Greedy ``steps`` one-token forwards through ``cache`` after it took ``ids``; the tokens."""
    logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
    tokens = []
    for step in range(steps):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        position = torch.full_like(token, ids.shape[1] + step)
        logits = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(tokens, dim=1)


def test_capture_happens_at_the_second_decode_step(tiny):
    """A bounded cache keeps its buffers from the first decode step on: that step warms up, the second is captured,
    and every later one is replayed."""
    model, _ = tiny
    ids = torch.randint(5, 400, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = EvictionCache(model, example_policy("h2o", 0.25), protocol="prefill", graphs="emulate")
    decode_steps(model, cache, ids, 12)
    assert cache.graphs.replays == 11


def held_state(cache):
    return [(layer.seen, layer.held.clone(), layer.position.clone(), layer.scores.clone()) for layer in cache.layers]


@pytest.mark.parametrize("batch", [1, 4])
def test_forks_decode_through_captures_of_their_own_and_leave_the_original_unchanged(tiny, batch):
    """Reference: eager decoding; implementation: emulated graphs. A compressed context answers two questions, the
    first from a fork, the second from the cache itself: the fork replays its own captures (never its original's),
    the original holds after the fork's decoding exactly what it held before, and both answer as eager ones do."""
    model, _ = tiny
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(5, 400, (batch, 48), generator=generator)
    questions = [torch.randint(5, 400, (batch, 4), generator=generator) for _ in range(2)]

    def answers(graphs):
        cache = EvictionCache(model, example_policy("h2o", 0.5), protocol="context", graphs=graphs)
        model(context, cache=cache, use_cache=True)
        before = held_state(cache)
        fork = cache.fork(list(range(batch)))
        first = decode_steps(model, fork, questions[0], 10)
        after = held_state(cache)
        for (seen, held, position, scores), (seen2, held2, position2, scores2) in zip(before, after, strict=True):
            assert seen == seen2 and torch.equal(held, held2) and torch.equal(position, position2)
            assert torch.equal(scores, scores2)
        return first, decode_steps(model, cache, questions[1], 10), fork, cache

    eager = answers(False)
    replayed = answers("emulate")
    assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1])
    fork, original = replayed[2], replayed[3]
    assert fork.graphs is not original.graphs
    assert fork.graphs.replays == 9 and original.graphs.replays == 9


@pytest.mark.parametrize(("decoding", "stack"), [("evict", False), ("grow", True)])
def test_answering_through_the_emulator_equals_eager_answering(tiny, decoding, stack):
    """Reference: eager decoding; implementation: emulated graphs, on the one generation path of several questions
    per context: forks at a batch of 1 and 3 documents, the oracle's full copy, and (``stack``) stacked cells, which
    decode eagerly. The same tokens for every cell and question."""
    model, tokenizer = tiny
    generator = torch.Generator().manual_seed(6)
    documents = [
        Document(
            torch.randint(5, 400, (40 + 3 * d,), generator=generator).tolist(),
            [torch.randint(5, 400, (3,), generator=generator).tolist() for _ in range(2)],
        )
        for d in range(3)
    ]
    cells = [Cell(example_policy(name, 0.5), "context") for name in ("full", "h2o", "snapkv", "oracle")]

    def tokens(graphs, batch_size):
        settings = Settings(8, batch_size, decoding=decoding, graphs=graphs, stack=stack)
        return [
            [row[2]["tokens"] for row in cell.rows] for cell in answer(model, tokenizer, cells, documents, settings)
        ]

    for batch_size in (1, 3):
        assert tokens("emulate", batch_size) == tokens(False, batch_size)


def test_a_model_with_sliding_layers_decodes_eagerly_under_emulated_graphs():
    """Gemma 3's sliding layers keep their window by concatenation: nothing is captured, and the tokens are eager
    decoding's."""
    model, _ = load_model("tiny-gemma3", device="cpu")
    ids = torch.randint(5, 400, (2, 20), generator=torch.Generator().manual_seed(7))
    caches = [
        EvictionCache(model, example_policy("h2o", 0.5), protocol="prefill", graphs=g) for g in (False, "emulate")
    ]
    eager, emulated = (decode_steps(model, cache, ids, 8) for cache in caches)
    assert torch.equal(emulated, eager)
    assert caches[1].graphs.replays == 0


def host_counts(cache):
    """Every layer's host counts: what was fed, and its layout's (not its slots, on the device, nor what it binds)."""
    counts = [{k: v for k, v in vars(layer.layout).items() if k not in ("slots", "bound")} for layer in cache.layers]
    return [(layer.seen, type(layer.layout), own) for layer, own in zip(cache.layers, counts, strict=True)]


@pytest.mark.parametrize(("name", "decoding"), [("h2o", "evict"), ("full", "grow")])
def test_a_capture_that_raises_leaves_the_cache_decoding_eagerly_with_one_warning(tiny, monkeypatch, name, decoding):
    """An out-of-memory error in the last layer of a capture, after the other layers wrote their slots and moved
    their counts: the cache's device and host state are as before the capture, the step and every later one run
    eagerly with one warning that names the cause and graphs=false, and the run's record says why."""
    model, tokenizer = tiny
    ids = torch.randint(5, 400, (2, 40), generator=torch.Generator().manual_seed(8))

    def cache(graphs):
        return EvictionCache(model, example_policy(name, 0.5), protocol="prefill", decoding=decoding, graphs=graphs)

    reference = cache(False)
    eager = decode_steps(model, reference, ids, 8)
    capture, advance = RecordedGraph.capture, EvictionLayer.advance
    capturing, restored = {"now": False}, []

    def failing_capture(self, step, owned):
        before = [tensor.clone() for tensor in owned()]
        capturing["now"] = True
        try:
            return capture(self, step, owned)
        except torch.OutOfMemoryError:
            restored.append(all(torch.equal(a, b) for a, b in zip(before, owned(), strict=True)))
            raise
        finally:
            capturing["now"] = False

    def failing_advance(self):
        if capturing["now"] and self.layer_idx == len(model.model.layers) - 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        advance(self)

    monkeypatch.setattr(RecordedGraph, "capture", failing_capture)
    monkeypatch.setattr(EvictionLayer, "advance", failing_advance)
    emulated = cache("emulate")
    with pytest.warns(RuntimeWarning, match=r"raised OutOfMemoryError: CUDA out of memory.*graphs=false") as caught:
        tokens = decode_steps(model, emulated, ids, 8)
    assert len([w for w in caught if "graphs=false" in str(w.message)]) == 1 and restored == [True]
    assert torch.equal(tokens, eager)
    assert str(host_counts(emulated)) == str(host_counts(reference))
    fork = emulated.fork([0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a copy of the cache does not try the capture again
        decode_steps(model, fork, tokens[:, -1:], 3)
    assert fork.graphs.failed == emulated.graphs.failed and len(restored) == 1
    assert emulated.graphs.replays == 0 and emulated.graphs.failed.startswith("OutOfMemoryError")
    log = GenerationLog(max_new_tokens=8)
    log.add(Batch(ids, torch.ones_like(ids)), torch.cat([ids, tokens], 1), emulated, 1.0, set())
    assert log.fields()["generation"]["graphs_failed"] == emulated.graphs.failed


def test_a_cache_with_graphs_is_freed_by_reference_counting_alone(tiny):
    """With the cycle collector off, dropping a cache whose decode steps were captured and replayed frees it and its
    buffers."""
    model, _ = tiny
    ids = torch.randint(5, 400, (1, 40), generator=torch.Generator().manual_seed(9))
    gc.collect()
    gc.disable()
    try:
        cache = EvictionCache(model, example_policy("h2o", 0.25), protocol="prefill", graphs="emulate")
        decode_steps(model, cache, ids, 6)
        assert cache.graphs.replays == 5
        dropped, keys = weakref.ref(cache), weakref.ref(cache.layers[0].slots.keys)
        del cache
        assert dropped() is None and keys() is None
    finally:
        gc.enable()


def test_the_emulator_refuses_a_step_that_reads_a_tensor_nobody_keeps():
    """As a CUDA graph reads addresses: a tensor made before the capture and kept by neither the cache nor the static
    inputs (a mask built for the capture and dropped) is refused at the capture, and the capture's writes undone."""
    buffer, mask = torch.zeros(4), torch.ones(4)

    def step():
        buffer.add_(1)
        buffer.mul_(mask)

    with pytest.raises(RuntimeError, match="neither the cache nor the step's static inputs keep"):
        RecordedGraph().capture(step, lambda: [buffer])
    assert buffer.tolist() == [0.0] * 4
    graph = RecordedGraph()
    graph.capture(step, lambda: [buffer, mask])
    graph.replay(lambda: [buffer, mask])
    graph.replay(lambda: [buffer, mask])
    assert buffer.tolist() == [2.0] * 4


def test_the_emulator_refuses_to_replay_on_buffers_other_than_those_captured():
    """A replay whose owners no longer hold what was captured (another cache's buffers, or a buffer replaced) is
    refused instead of writing to memory a CUDA graph would find freed."""
    buffer = torch.zeros(4)
    graph = RecordedGraph()
    graph.capture(lambda: buffer.add_(1), lambda: [buffer])
    graph.replay(lambda: [buffer])
    with pytest.raises(RuntimeError, match="captured for other buffers"):
        graph.replay(lambda: [torch.zeros(4)])


def test_a_run_with_graphs_emulate_answers_as_eager_decoding(data_dir, tmp_path, monkeypatch):
    """The CLI's ``graphs=emulate`` reaches the caches of a run (their steps are replayed): a RULER-style task under
    H2O answers, keeps and holds exactly as with ``graphs=false``."""
    settings = {"model": "tiny-llama", "task": "niah_single_1", "limit": 2, "batch_size": 2, "policy": "h2o"}
    settings |= {"task.length": 300, "task.max_new_tokens": 6, "budget": 0.5}
    model, tokenizer = load_model("tiny-llama", device="cpu")
    replays, replay = [], RecordedGraph.replay
    monkeypatch.setattr(RecordedGraph, "replay", lambda self, owned: replays.append(1) or replay(self, owned))
    runs = []
    for graphs in (False, "emulate"):
        config = validate(make_config(data_dir, tmp_path, **settings, graphs=graphs)).config
        runs.append(runner_of(config["task"]).evaluate(model, tokenizer, configured_policy(config), config))
    keys = ("id", "prediction", "capacity", "generated_tokens", "kv_entries")
    assert [[o[k] for k in keys] for o in runs[1].outputs] == [[o[k] for k in keys] for o in runs[0].outputs]
    assert len(replays) >= 3


@torch.no_grad()
def test_a_replayed_step_refuses_to_outgrow_a_window_on_every_layer_as_an_eager_one():
    """Mistral-style, every layer sliding over 16 tokens: replayed decode steps refuse the 17th token with the eager
    step's error instead of running past the window."""
    model = random_model("mistral", **SMALL, num_key_value_heads=1, sliding_window=16)
    cache = EvictionCache(model, make_policy("h2o", budget=8), protocol="prefill", graphs="emulate")
    decode_steps(model, cache, torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(10)), 4)
    assert cache.graphs.replays == 3
    with pytest.raises(ConfigError, match=r"^a sequence of 17 tokens is longer than the sliding window \(16\)"):
        model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[16]]), cache=cache, use_cache=True)


def test_a_dynamic_rotary_embedding_is_never_captured(tiny):
    """Transformers' dynamic RoPE compares the positions with its cached length on the host every forward, which a
    capture refuses: such a model's caches decode eagerly."""
    model, _ = load_model("tiny-llama", device="cpu")
    assert EvictionCache(model, example_policy("h2o"), protocol="prefill", graphs="emulate").graphs is not None
    model.model.rotary_emb.rope_type = "dynamic"
    assert EvictionCache(model, example_policy("h2o"), protocol="prefill", graphs="emulate").graphs is None


@torch.no_grad()
def test_a_cache_replays_its_captures_after_another_cache_made_constants_of_its_own(tiny):
    """A replay finds what it reads by address, not by its place among the tensors a cache and its model own: an H2O
    cache replays on after a TOVA cache (another rule, other constants) has decoded between its steps."""
    model, _ = tiny
    ids = torch.randint(5, 400, (1, 40), generator=torch.Generator().manual_seed(11))

    def interleaved(graphs):
        first = EvictionCache(model, make_policy("h2o", 16), protocol="prefill", graphs=graphs)
        tokens = decode_steps(model, first, ids, 4)
        other = EvictionCache(model, make_policy("tova", 16), protocol="prefill", graphs=graphs)
        decode_steps(model, other, ids, 2)
        return torch.cat([tokens, decode_steps(model, first, torch.cat([ids, tokens], 1), 4)], 1), first

    eager, _ = interleaved(False)
    replayed, cache = interleaved("emulate")
    assert torch.equal(replayed, eager) and cache.graphs.replays >= 5


def test_the_emulator_replays_a_view_of_another_dtype_as_captured():
    """A step that reads a buffer through a view of another dtype (int32 pairs as int64) replays that view."""
    buffer, total = torch.arange(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)
    graph = RecordedGraph()
    graph.capture(lambda: total.add_(buffer.view(torch.int64)), lambda: [buffer, total])
    expected = total.clone() * 2
    graph.replay(lambda: [buffer, total])
    graph.replay(lambda: [buffer, total])
    assert torch.equal(total, expected)
