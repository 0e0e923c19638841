"""Triton kernels against their PyTorch references, under TRITON_INTERPRET=1 (set in conftest)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import RULES, make_chunk
from h2o_eval.kernels import decode_attention as decode_module
from h2o_eval.kernels.column_scores import column_scores
from h2o_eval.kernels.decode_attention import decode_attention, split_slots
from h2o_eval.kernels.eviction_scan import eviction_scan
from h2o_eval.kernels.reference import column_scores_reference, decode_attention_reference

from h2o_eval.eviction import attend_chunk_reference, attend_chunk_triton

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
HEADS = [(4, 4), (6, 2), (8, 2)]  # (query heads, KV heads): GQA ratios 1, 3, 4


@pytest.mark.parametrize(
    ("batch", "heads", "length", "dim", "dtype"),
    list(itertools.product([1, 2], HEADS, [1, 17, 64, 65], [64], [torch.float32]))
    + [(2, (6, 2), 130, 128, torch.float32), (2, (8, 2), 65, 64, torch.float16), (2, (6, 2), 33, 128, torch.bfloat16)],
)
@pytest.mark.parametrize("rows", ["all", "last"])
def test_column_scores_kernel_equals_reference(batch, heads, length, dim, dtype, rows):
    """Reference: column_scores_reference (PyTorch, blocks of rows); implementation: the two-pass Triton kernel,
    64-row and 64-key tiles, so 17, 65 and 130 tokens end inside a tile. The first sequence is left-padded, the
    second right-padded; rows are weighted all (H2O's column sums) or last only (TOVA)."""
    q_heads, kv_heads = heads
    gen = torch.Generator().manual_seed(length * 3 + dim)
    query = torch.randn(batch, q_heads, length, dim, generator=gen).to(dtype)
    key = torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype)
    value = torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, : min(3, length - 1)] = False
    if batch > 1 and length > 4:
        valid[1, -4:] = False
    last = (valid.cumsum(-1) == valid.sum(-1, keepdim=True)) & valid
    weights = (valid if rows == "all" else last).float()
    expected, expected_columns = column_scores_reference(query, key, value, valid, weights, dim**-0.5)
    got, columns = column_scores(query, key, value, valid, weights, dim**-0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(columns, expected_columns, rtol=1e-4, atol=1e-4)
    assert expected_columns.sum() > 0


@pytest.mark.parametrize("block", [5, 16, 128])
@pytest.mark.parametrize("rows", ["all", "window", "none"])
@pytest.mark.parametrize("padding", [True, False])
def test_column_scores_reference_equals_the_whole_matrix(block, rows, padding):
    """Reference: the T x T definition, one softmax over the whole masked matrix; implementation: the CPU path,
    fused attention for the output and blocks of weighted rows for the columns (5 and 16 end inside the prompt,
    128 holds it whole). Left and right padding or none, GQA 3; rows weighted all at random (H2O), in a 6-row
    window that starts mid-block (SnapKV: the rows before its block take the fused path), or none."""
    batch, q_heads, kv_heads, length, dim = 2, 6, 2, 37, 16
    gen = torch.Generator().manual_seed(block)
    query = torch.randn(batch, q_heads, length, dim, generator=gen)
    key = torch.randn(batch, kv_heads, length, dim, generator=gen)
    value = torch.randn(batch, kv_heads, length, dim, generator=gen)
    valid = torch.ones(batch, length, dtype=torch.bool)
    if padding:
        valid[0, :4] = False
        valid[1, -3:] = False
    weights = {
        "all": torch.rand(batch, length, generator=gen) * valid,
        "window": torch.zeros(batch, length).index_fill_(1, torch.arange(length - 9, length - 3), 1.0),
        "none": torch.zeros(batch, length),
    }[rows]
    cols = torch.arange(length)
    causal = cols.view(-1, 1) >= cols.view(1, -1)
    seen = causal & (valid.view(batch, 1, length) | torch.eye(length, dtype=torch.bool))
    logits = query.view(batch, kv_heads, 3, length, dim) @ key.unsqueeze(2).transpose(-1, -2) / dim**0.5
    probs = torch.softmax(logits.masked_fill(~seen.view(batch, 1, 1, length, length), -torch.inf), dim=-1)
    expected = (probs @ value.unsqueeze(2)).view(batch, q_heads, length, dim)
    expected_columns = (probs * weights.view(batch, 1, 1, length, 1)).sum(dim=(2, 3))
    output, columns = column_scores_reference(query, key, value, valid, weights, dim**-0.5, block=block)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(columns, expected_columns, rtol=1e-5, atol=1e-5)
    assert (expected_columns.sum() > 0) == (rows != "none")


SCAN_GRID = [
    # batch, heads, new tokens, state slots, padding, head dim, dtype
    (2, (4, 4), 17, 0, "left", 64, torch.float32),
    (1, (6, 2), 9, 5, "none", 64, torch.float32),
    (2, (8, 2), 13, 0, "right", 64, torch.float32),
    (1, (8, 2), 1, 6, "none", 128, torch.float32),
    (1, (6, 2), 15, 3, "none", 128, torch.float16),
    (1, (8, 2), 15, 0, "none", 64, torch.bfloat16),
]


def run_scan(query, key, value, chunk, **kwargs):
    return eviction_scan(
        query, key, value, chunk.held, chunk.arriving, chunk.position, chunk.scores, chunk.capacity,
        chunk.recent, chunk.sinks, chunk.rule.decode_votes, chunk.scaling, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(("batch", "heads", "n", "state", "padding", "dim", "dtype"), SCAN_GRID)
@pytest.mark.parametrize("rule", ["h2o", "tova", "static"])
def test_eviction_scan_kernel_equals_reference(batch, heads, n, state, padding, dim, dtype, rule):
    """Reference: attend_chunk_reference (the mechanism's definition, a torch loop over rows); implementation:
    the Triton scan of the decode rows (one program per sequence and KV head). Capacities of 3-6 slots, different
    per KV head, force an eviction on nearly every row; 64-slot blocks hold every slot here, the test below and
    the decode test cover the block edges."""
    query, key, value, chunk = make_chunk(batch, *heads, n, state, RULES[rule], 0, padding, dim=dim, dtype=dtype)
    expected = attend_chunk_reference(query, key, value, chunk)
    out, held, scores = run_scan(query, key, value, chunk)
    assert torch.equal(held, expected.held)
    rows = chunk.arriving.view(batch, 1, n, 1).expand_as(out)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[rows].float(), expected.output[rows].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(scores[held], expected.scores[held], rtol=1e-5, atol=1e-5)
    assert (held.sum(-1) <= torch.maximum(chunk.capacity, torch.tensor(state))).all()


def test_eviction_scan_kernel_crosses_slot_blocks():
    """Reference: attend_chunk_reference; implementation: the Triton scan with 16-slot blocks. The first
    sequence holds up to 33 slots, so its victim search, softmax and score update span three blocks of the held
    list, the last one partial; the second (capacity 9) evicts on most rows."""
    query, key, value, chunk = make_chunk(2, 6, 2, 30, 7, RULES["h2o"], 0, "left", dim=64)
    chunk.capacity = torch.tensor([[33, 33], [9, 9]])
    expected = attend_chunk_reference(query, key, value, chunk)
    out, held, scores = run_scan(query, key, value, chunk, block_slots=16)
    assert torch.equal(held, expected.held)
    rows = chunk.arriving.view(2, 1, 30, 1).expand_as(out)
    torch.testing.assert_close(out[rows], expected.output[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores[held], expected.scores[held], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize(
    ("batch", "heads", "n", "prefill", "padding"),
    [(2, (6, 2), 21, 13, "right"), (1, (8, 2), 17, 99, "none"), (2, (4, 4), 19, 11, "left")],
)
def test_triton_path_equals_reference_with_prompt_and_compression(rule, batch, heads, n, prefill, padding):
    """Reference: attend_chunk_reference; implementation: attend_chunk_triton, the whole mechanism on the Triton
    kernels: the prompt's votes from column_scores, compression (pooling, Ada-KV's shared slots), then the decode
    rows through eviction_scan (or plain masked attention for rules that grow), with ragged heads and padding."""
    query, key, value, chunk = make_chunk(batch, *heads, n, 0, RULES[rule], prefill, padding, dim=64)
    expected = attend_chunk_reference(query, key, value, chunk)
    result = attend_chunk_triton(query, key, value, chunk)
    rows = chunk.arriving.view(batch, 1, n, 1).expand_as(result.output)
    torch.testing.assert_close(result.output[rows], expected.output[rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(result.held, expected.held)
    assert torch.equal(result.capacity, expected.capacity) and torch.equal(result.kept, expected.kept)


def decode_case(batch, q_heads, kv_heads, slots, dim, dtype, seed=0):
    """Random query [B, Hq, D], keys, values [B, Hkv, S, D] in ``dtype``, about 70 % of the slots held (slot 0
    always) and random float32 scores."""
    gen = torch.Generator().manual_seed(seed * 1000 + slots)
    query = torch.randn(batch, q_heads, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    held = torch.rand(batch, kv_heads, slots, generator=gen) > 0.3
    held[..., 0] = True
    return query, keys, values, held, torch.rand(batch, kv_heads, slots, generator=gen)


def check_decode(query, keys, values, held, base, **kwargs):
    """decode_attention against decode_attention_reference: output and scores within the dtype's tolerance,
    the scores of slots not held unchanged."""
    scale = query.shape[-1] ** -0.5
    expected_scores, scores = base.clone(), base.clone()
    expected = decode_attention_reference(query, keys, values, held, expected_scores, scale)
    got = decode_attention(query, keys, values, held, scores, scale, **kwargs)
    tol = TOLERANCE[query.dtype]
    assert got.dtype == query.dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(scores, expected_scores, rtol=tol, atol=tol)
    assert torch.equal(scores[~held], base[~held])
    assert not torch.equal(scores[held], base[held])


@pytest.mark.parametrize(
    ("batch", "heads", "slots", "dim", "dtype"),
    list(itertools.product([1, 2], [(2, 2), (4, 2), (8, 2), (8, 1)], [1, 15, 16, 17, 40], [16], [torch.float32]))
    + [(2, (8, 2), 40, 32, torch.float16), (1, (8, 1), 17, 32, torch.bfloat16), (2, (4, 2), 33, 16, torch.bfloat16)],
)
def test_decode_attention_kernel_equals_reference(batch, heads, slots, dim, dtype):
    """Reference: decode_attention_reference (PyTorch); implementation: the flash-decoding kernels with 16-slot
    tiles and the split count they pick themselves (a few splits here), over GQA ratios 1, 2, 4 and 8 (MHA, GQA,
    MQA): 1, 15, 16 and 17 slots sit at and around one tile, 40 make three splits, the last partial."""
    check_decode(*decode_case(batch, *heads, slots, dim, dtype), block_slots=16)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_decode_attention_combines_splits_with_partial_and_empty_ones(dtype):
    """Reference: decode_attention_reference; implementation: the kernels forced to 6 splits of one 16-slot tile
    over 83 slots (the last split 3 slots), GQA 4, two sequences: random holes; a head whose held slots all sit
    in one split (the others hold none); a split with no held slot; a head holding only the last, partial split
    and slot 0."""
    query, keys, values, held, base = decode_case(2, 8, 2, 83, 16, dtype)
    held[0, 1] = False
    held[0, 1, 32:48] = True
    held[1, 0, 16:32] = False
    held[1, 1] = False
    held[1, 1, 0] = held[1, 1, 80:] = True
    check_decode(query, keys, values, held, base, block_slots=16, splits=6)


def test_decode_attention_host_code_reads_no_tensor_values(monkeypatch):
    """The decode step must not synchronise with the device: decode_attention's host code runs on meta tensors
    (which have no values: reading one, as item, bool, nonzero or boolean-mask indexing do, raises), with the
    kernel launches recorded instead of run. It launches both passes on the same grid, (B * Hkv, splits)."""
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(decode_module, "_partials_kernel", Launcher())
    monkeypatch.setattr(decode_module, "_combine_kernel", Launcher())
    meta = torch.device("meta")
    query = torch.empty(8, 32, 128, dtype=torch.bfloat16, device=meta)
    keys, values = (torch.empty(8, 8, 6554, 128, dtype=torch.bfloat16, device=meta) for _ in range(2))
    held = torch.empty(8, 8, 6554, dtype=torch.bool, device=meta)
    scores = torch.empty(8, 8, 6554, dtype=torch.float32, device=meta)
    output = decode_attention(query, keys, values, held, scores, 128**-0.5)
    assert output.shape == query.shape and output.dtype == query.dtype
    splits, _ = split_slots(64, 6554, 64, meta)
    assert launches == [(64, splits)] * 2


def test_split_slots_aims_at_programs_per_sm_in_whole_tiles():
    """Reference: the rule stated by split_slots (4 programs per SM, 16 SMs off CUDA, whole 64-slot tiles, at
    most one split per tile); implementation: its choice for a batch-1 GQA head count, a batch large enough alone,
    and a cache smaller than a tile."""
    cpu = torch.device("cpu")
    assert split_slots(8, 6554, 64, cpu) == (8, 832)  # 103 tiles in 8 splits of 13
    assert split_slots(64, 6554, 64, cpu) == (1, 6592)
    assert split_slots(1, 40, 64, cpu) == (1, 64)
    assert split_slots(2, 130, 16, cpu) == (9, 16)  # 9 tiles, one split each


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_eviction_cache_decodes_the_same_with_the_triton_kernel(name):
    """Reference: EvictionCache with kernels=torch; implementation: kernels=triton (the decode kernel in every
    evicting step), fed token by token with dozens of evictions."""
    from h2o_eval import EvictionCache, load_model, make_policy

    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(100, 40000, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernels in ("torch", "triton"):
        cache = EvictionCache(model, make_policy(name, budget=6), kernels=kernels)
        with torch.no_grad():
            logits[kernels] = torch.cat(
                [model(ids[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(24)], dim=1
            )
    assert (logits["torch"] - logits["triton"]).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming"])
def test_simulate_equals_token_by_token_with_triton_kernels(name):
    """Reference: EvictionCache fed one token at a time with kernels=triton (the decode kernel); implementation:
    patch(simulate, kernels=triton), one forward (the scan kernel in every layer). Two sequences of 20 tokens at
    a budget of 5 tokens: 15 evictions per KV head and layer."""
    from h2o_eval import EvictionCache, load_model, make_policy, patch

    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(100, 40000, (2, 20), generator=torch.Generator().manual_seed(3))
    policy = make_policy(name, budget=5)
    with torch.no_grad(), patch(model, policy, kernels="triton"):
        simulated = model(ids).logits
    cache = EvictionCache(model, policy, kernels="triton")
    with torch.no_grad():
        stepped = torch.cat([model(ids[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(20)], dim=1)
        plain = model(ids).logits
    assert (simulated - stepped).abs().max() <= 1e-4
    assert all(layer.keys.shape[2] == 5 for layer in cache.layers)
    assert (simulated - plain).abs().max() > 1e-2, "eviction changed nothing: the test proves nothing"


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_prefill_protocol_with_triton_kernels_equals_the_torch_reference(name):
    """Reference: patch(prefill, kernels=torch), the plain loop; implementation: patch(prefill, kernels=triton):
    the 24-token context's scores from the column-score kernel, the 12-token continuation through the scan
    kernel with one eviction per token (budget 0.25 of the context: C = 6)."""
    from h2o_eval import load_model, make_policy, patch

    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(100, 40000, (1, 36), generator=torch.Generator().manual_seed(4))
    policy = make_policy(name, budget=0.25)
    logits = {}
    for kernels in ("torch", "triton"):
        with torch.no_grad(), patch(model, policy, protocol="prefill", kernels=kernels) as session:
            session.context_lengths = [24]
            logits[kernels] = model(ids).logits
    assert (logits["torch"] - logits["triton"]).abs().max() <= 1e-4
    with torch.no_grad():
        assert (logits["torch"][:, 24:] - model(ids).logits[:, 24:]).abs().max() > 1e-2


def test_forcing_triton_where_it_cannot_run_is_refused(monkeypatch, tmp_path):
    from conftest import make_config

    from h2o_eval import EvictionCache, load_model, make_policy, patch
    from h2o_eval.errors import ConfigError
    from h2o_eval.run import validate

    model, _ = load_model("tiny-llama", device="cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="kernels=triton needs a CUDA device, not cpu"):
        EvictionCache(model, make_policy("h2o", budget=8), kernels="triton")
    with (
        pytest.raises(ConfigError, match="kernels=triton needs a CUDA device, not cpu"),
        patch(model, make_policy("h2o"), kernels="triton"),
    ):
        pass
    with pytest.raises(ConfigError, match="kernels=triton needs a CUDA device, not cpu"):
        validate(make_config(None, tmp_path, kernels="triton", device="cpu"))
