"""Triton kernels against their PyTorch references, under TRITON_INTERPRET=1 (set in conftest)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import RULES, fast_sample, make_chunk
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

from h2o_eval.eviction import attend_chunk_reference
from h2o_eval.implementation import choose
from h2o_eval.kernels import decode_attention as decode_module
from h2o_eval.kernels.column_scores import attention_lse, column_sums
from h2o_eval.kernels.decode_attention import decode_attention, split_slots
from h2o_eval.kernels.eviction_scan import eviction_scan
from h2o_eval.kernels.prompt import fused_attention_lse, prompt_votes
from h2o_eval.kernels.reference import (
    attention_lse_reference,
    column_scores_reference,
    column_sums_reference,
    decode_attention_reference,
)
from h2o_eval.policies import Rule

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
VOTES = {
    "all": Rule(votes="all"),
    "window": Rule(votes="window", window=5),
    "last": Rule(votes="all", combine="replace"),
}


def prompt(batch, q_heads, kv_heads, length, dim, dtype, padding, seed=0):
    """Random query [B, Hq, T, D], key, value [B, Hkv, T, D] in ``dtype`` and valid [B, T]: ``padding`` none, left
    (3 tokens on the first sequence), right (4 on the last) or both."""
    gen = torch.Generator().manual_seed(seed * 1000 + length)
    query = torch.randn(batch, q_heads, length, dim, generator=gen).to(dtype)
    key = torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype)
    value = torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype)
    valid = torch.ones(batch, length, dtype=torch.bool)
    if padding in ("left", "both") and length > 3:
        valid[0, :3] = False
    if padding in ("right", "both") and length > 4:
        valid[-1, -4:] = False
    return query, key, value, valid


def whole_matrix(query, key, value, valid, scaling):
    """The T x T definition: (output [B, Hq, T, D] float32, lse [B, Hq, T], probs [B, Hkv, G, T, T]), one masked
    softmax per row over the keys it sees (earlier real tokens and itself)."""
    batch, q_heads, length, dim = query.shape
    kv_heads = key.shape[1]
    cols = torch.arange(length)
    seen = (cols.view(-1, 1) >= cols.view(1, -1)) & (valid.view(batch, 1, length) | torch.eye(length, dtype=torch.bool))
    grouped = query.float().view(batch, kv_heads, q_heads // kv_heads, length, dim)
    logits = grouped @ key.float().unsqueeze(2).transpose(-1, -2) * scaling
    logits = logits.masked_fill(~seen.view(batch, 1, 1, length, length), -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    output = (probs @ value.float().unsqueeze(2)).view(batch, q_heads, length, dim)
    return output, logits.logsumexp(-1).view(batch, q_heads, length), probs


PROMPTS = [
    # batch, (query heads, KV heads), tokens, head dim, dtype, padding
    (2, (4, 4), 17, 32, torch.float32, "left"),  # MHA, inside one 64-key tile
    (1, (4, 2), 64, 16, torch.float32, "none"),  # GQA 2, one whole tile
    (2, (8, 2), 65, 16, torch.float16, "right"),  # GQA 4, one key past a tile
    (1, (8, 1), 63, 32, torch.bfloat16, "none"),  # MQA (8 query heads), one key short of a tile
    (2, (4, 2), 130, 16, torch.float32, "both"),  # three tiles, the last partial
    (1, (2, 2), 1, 16, torch.float32, "none"),  # a single token
]


@pytest.mark.parametrize(("batch", "heads", "length", "dim", "dtype", "padding"), PROMPTS)
@pytest.mark.parametrize("rows", fast_sample(list(VOTES), lambda rows: rows == "all"))
def test_prompt_votes_triton_path_equals_column_scores_reference(batch, heads, length, dim, dtype, padding, rows):
    """Reference: column_scores_reference (the definition, and the CPU path); implementation: prompt_votes with
    ``triton``: the fused attention's output and log-sum-exp (the Triton log-sum-exp pass where padding rules the
    fused kernel out), then the Triton column pass over 64-key tiles. Rows vote as H2O (all), SnapKV (a 5-row
    window) or TOVA (the last row) do; without the output, only the voting rows' log-sum-exp is computed."""
    query, key, value, valid = prompt(batch, *heads, length, dim, dtype, padding)
    weights = VOTES[rows].prompt_weights(valid)
    scaling = dim**-0.5
    expected, expected_columns = column_scores_reference(query, key, value, valid, weights, scaling)
    output, columns = prompt_votes(query, key, value, valid, weights, scaling, output=True, triton=True)
    none, alone = prompt_votes(query, key, value, valid, weights, scaling, output=False, triton=True)
    tol = TOLERANCE[dtype]
    assert output.dtype == dtype and none is None
    torch.testing.assert_close(output.float(), expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(columns, expected_columns, rtol=max(tol, 1e-4), atol=max(tol, 1e-4))
    torch.testing.assert_close(alone, expected_columns, rtol=max(tol, 1e-4), atol=max(tol, 1e-4))
    assert expected_columns.sum() > 0


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_fused_attention_lse_is_the_natural_log_sum_exp_of_the_scaled_logits(dtype):
    """Reference: the T x T masked softmax of the scaled logits and its natural-log logsumexp, per query head
    [B, Hq, T]; implementation: fused_attention_lse on the CPU (torch's flash kernel for the CPU, what the Triton
    path runs in the interpreter), given 2 KV heads for 8 query heads as they are (query head h*G+g reads KV head
    h)."""
    query, key, value, valid = prompt(2, 8, 2, 37, 16, dtype, "none")
    expected, expected_lse, _ = whole_matrix(query, key, value, valid, 0.3)
    output, lse = fused_attention_lse(query, key, value, 0.3)
    assert lse.shape == (2, 8, 37) and lse.dtype == torch.float32 and output.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(lse, expected_lse, rtol=tol, atol=tol)
    torch.testing.assert_close(output.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_attention_lse_equals_the_whole_matrix_from_each_start(triton, dtype):
    """Reference: the T x T masked softmax and its logsumexp; implementation: attention_lse (Triton, 16-row and
    16-key tiles) or attention_lse_reference (PyTorch, 16-row blocks) over a left- and right-padded pair, GQA 4:
    every row with the output, then only the rows from a start per sequence (21 and 38, inside tiles) without it,
    the rows before it left NaN."""
    query, key, value, valid = prompt(2, 8, 2, 45, 16, dtype, "both")
    expected, expected_lse, _ = whole_matrix(query, key, value, valid, 0.25)
    start = torch.tensor([21, 38])
    if triton:
        output, lse = attention_lse(query, key, value, valid, 0.25, block_rows=16, block_cols=16)
        none, part = attention_lse(query, key, value, valid, 0.25, start, block_rows=16, block_cols=16)
    else:
        output, lse = attention_lse_reference(query, key, value, valid, 0.25, block=16)
        none, part = attention_lse_reference(query, key, value, valid, 0.25, start, block=16)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(output.float(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)
    assert none is None
    for b, first in enumerate(start.tolist()):
        torch.testing.assert_close(part[b, :, first:], expected_lse[b, :, first:], rtol=1e-5, atol=1e-5)
        assert part[b, :, :first].isnan().all()


@pytest.mark.parametrize(("block_rows", "block_cols"), [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("rows", list(VOTES))
def test_column_sums_kernel_and_reference_equal_the_whole_matrix(block_rows, block_cols, rows):
    """Reference: the T x T masked softmax, its probabilities weighted per row and summed over rows and the
    group; implementation: column_sums (Triton) with row and key tiles of different sizes, so row tiles start
    mid key tile and the causal tiles end anywhere, and column_sums_reference in 16-row blocks, both from the
    exact log-sum-exp; 45 tokens padded left and right, GQA 3."""
    query, key, value, valid = prompt(2, 6, 2, 45, 16, torch.float32, "both")
    weights = VOTES[rows].prompt_weights(valid) * torch.rand(2, 45, generator=torch.Generator().manual_seed(1))
    _, lse, probs = whole_matrix(query, key, value, valid, 0.25)
    expected = (probs * weights.view(2, 1, 1, 45, 1)).sum(dim=(2, 3))
    got = column_sums(query, key, valid, lse, weights, 0.25, block_rows=block_rows, block_cols=block_cols)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(column_sums_reference(query, key, valid, lse, weights, 0.25, block=16), expected)


class LogitCount(TorchDispatchMode):
    """Counts the elements of every matrix product's result (the logits a PyTorch path computes)."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.mv):
            self.elements += result.numel()
        return result


@pytest.mark.parametrize("rows", list(VOTES))
def test_column_pass_visits_no_row_before_the_first_voter(monkeypatch, rows):
    """Counts the work: the Triton column kernel (16-row, 16-key tiles, 96 tokens, 2 query heads on one KV head)
    does one tl.dot per (key tile, query head, row tile from max(the key tile's first key, the first voter)): 21
    row tiles per head for H2O, one per key tile (6) for SnapKV's window and TOVA's last row; the Triton
    log-sum-exp pass from the first voter, one dot per key tile of each row tile that reaches it. On the CPU path,
    prompt_votes without the output multiplies out at most 2 x (rows from the first voter) x T logits per query
    head."""
    query, key, value, valid = prompt(1, 2, 1, 96, 16, torch.float32, "none")
    weights = VOTES[rows].prompt_weights(valid)
    first = int((weights[0] != 0).int().argmax())
    lse = whole_matrix(query, key, value, valid, 0.25)[1]
    dots = []
    counted = interpreter.InterpreterBuilder.create_dot

    def create_dot(builder, *args):
        dots.append(1)
        return counted(builder, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    column_sums(query, key, valid, lse, weights, 0.25, block_rows=16, block_cols=16)
    assert len(dots) == 2 * sum(-(-(96 - max(16 * j, first)) // 16) for j in range(6))
    assert len(dots) == {"all": 42, "window": 12, "last": 12}[rows]
    dots.clear()
    attention_lse(query, key, value, valid, 0.25, torch.tensor([first]), block_rows=16, block_cols=16)
    assert len(dots) == 2 * sum(block + 1 for block in range(first // 16, 6))
    with LogitCount() as counter:
        prompt_votes(query, key, value, valid, weights, 0.25, output=False)
    assert 0 < counter.elements <= 2 * 2 * (96 - first) * 96


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
@pytest.mark.parametrize("rule", fast_sample(["h2o", "tova", "static"], lambda rule: rule == "h2o"))
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


@pytest.mark.parametrize("rule", fast_sample(list(RULES), lambda rule: rule in ("h2o", "snapkv", "adakv")))
@pytest.mark.parametrize(
    ("batch", "heads", "n", "prefill", "padding"),
    [(2, (6, 2), 21, 13, "right"), (1, (8, 2), 17, 99, "none"), (2, (4, 4), 19, 11, "left")],
)
def test_triton_path_equals_reference_with_prompt_and_compression(rule, batch, heads, n, prefill, padding):
    """Reference: attend_chunk_reference; implementation: the chunk function ``kernels=triton`` chooses, the whole
    mechanism on the Triton kernels: the prompt's votes from column_scores, compression (pooling, Ada-KV's shared
    slots), then the decode rows through eviction_scan (or plain masked attention for rules that grow), with ragged
    heads and padding."""
    query, key, value, chunk = make_chunk(batch, *heads, n, 0, RULES[rule], prefill, padding, dim=64)
    expected = attend_chunk_reference(query, key, value, chunk)
    result = choose("triton", query.device).chunk(query, key, value, chunk)
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
