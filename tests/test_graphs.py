"""Decode steps as CUDA graphs (h2o_eval.graphs), proven on the CPU: :class:`RecordedGraph` replays a captured step's
aten operations with a CUDA graph's semantics (the host's code is not run again, tensors made during the capture are
reused), so a step that depended on anything but its static buffers would replay wrong. Reference: eager decoding;
implementation: the same generation with every capturable step captured once per set of buffers and replayed."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST_POLICIES, fast_sample, registered

from h2o_eval import EvictionCache, load_model
from h2o_eval.benchmarks.decode_ops import count
from h2o_eval.generation import Batch, complete, greedy
from h2o_eval.graphs import DecodeGraphs, RecordedGraph, install
from h2o_eval.policies import example_policy

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
    cache = EvictionCache(model, example_policy(name, 0.5), protocol="prefill", decoding=decoding)
    if graphs:
        cache.graphs = DecodeGraphs(cache, RecordedGraph)
        install(model)
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
    monkeypatch.setattr("h2o_eval.layer.AHEAD", 8)
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
    graph.capture(step)
    graph.replay()  # the capture's own run
    graph.replay()
    graph.replay()
    assert buffer.tolist() == [3.0, 0.0, 0.0, 0.0]  # eagerly it would be [1, 1, 1, 0]


def test_a_captured_step_that_reads_a_value_on_the_host_is_refused():
    values = torch.arange(4.0)
    with pytest.raises(RuntimeError, match="reads a tensor's value on the host"):
        RecordedGraph().capture(lambda: values[int(values.argmax())])


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
    ("name", "decoding"),
    fast_sample(
        [(name, decoding) for name in registered("prefill") for decoding in ("evict", "grow")],
        lambda case: case[0] in FAST_POLICIES[:3],
    ),
)
def test_an_eviction_cache_adds_at_most_sixteen_operations_per_layer_to_a_decode_step(name, decoding):
    """Reference: plain transformers' decode step (a DynamicCache, SDPA); implementation: the same step through an
    EvictionCache, 16 steps after a 96-token prompt. Counted as computing aten operations per layer and step, each a
    kernel launch on a GPU (benchmarks.decode_ops)."""
    model, tokenizer = load_model("tiny-llama3", device="cpu")
    layers, steps = model.config.num_hidden_layers, 16
    plain = count(model, tokenizer, None, "evict", 96, steps, 0.25).total
    added = (count(model, tokenizer, name, decoding, 96, steps, 0.25).total - plain) / layers / steps
    assert added <= 16
