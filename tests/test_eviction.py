"""The mechanism itself: the fast paths against the plain row loop, and hand-worked examples."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import RULES, fast_sample, make_chunk

from h2o_eval.chunks import attend_chunk
from h2o_eval.compression import compress
from h2o_eval.eviction import Chunk, attend_chunk_reference
from h2o_eval.policies import UNBOUNDED, Rule
from h2o_eval.policies.h2o_reference import reference_keep_mask
from h2o_eval.policies.pooling import pool_scores

HEADS = [(4, 4), (6, 2), (8, 2)]  # (query heads, KV heads): GQA ratios 1, 3, 4
GRID = [
    (batch, heads, n, state, rule, prefill, padding)
    for batch, heads, n, state, rule in itertools.product([1, 3], HEADS, [1, 7, 33], [0, 5], list(RULES))
    for prefill, padding in [(0, "none"), (0, "left"), (4, "right"), (99, "left"), (99, "right")]
    if not (state and prefill)  # prompt rows exist only on an empty cache
]


def assert_same_result(result, expected, chunk, atol=1e-5):
    batch, _, n, _ = result.output.shape
    rows = chunk.arriving.view(batch, 1, n, 1).expand_as(result.output)
    torch.testing.assert_close(result.output[rows].float(), expected.output[rows].float(), rtol=atol, atol=atol)
    assert torch.equal(result.held, expected.held)
    torch.testing.assert_close(result.scores[result.held], expected.scores[expected.held], rtol=1e-5, atol=1e-5)
    assert torch.equal(result.capacity, expected.capacity)
    assert (result.kept is None) == (expected.kept is None)
    if result.kept is not None:
        assert torch.equal(result.kept, expected.kept)


@pytest.mark.parametrize(
    ("batch", "heads", "n", "state", "rule", "prefill", "padding"),
    fast_sample(GRID, lambda case: case[0] == 3 and case[1] == (8, 2)),  # every rule at batch 3 and GQA 4:1 by default
)
def test_fast_cpu_path_equals_the_row_loop(batch, heads, n, state, rule, prefill, padding):
    """Reference: attend_chunk_reference (a torch loop over rows, compression as single evictions);
    implementation: attend_chunk (column sums for the prompt, vectorised compression, the numba scan or plain
    masked attention for the decode rows). Capacities differ per KV head (ragged heads)."""
    query, key, value, chunk = make_chunk(batch, *heads, n, state, RULES[rule], prefill, padding)
    expected = attend_chunk_reference(query, key, value, chunk)
    result = attend_chunk(query, key, value, chunk)
    assert_same_result(result, expected, chunk)
    held = result.held.sum(-1)
    if RULES[rule].grows and prefill:  # after the prompt nothing is evicted
        assert (result.capacity == UNBOUNDED).all()
    elif RULES[rule].safeguard is None:
        assert (held <= torch.maximum(chunk.capacity, torch.tensor(state))).all()


@pytest.mark.parametrize("rule", ["static", "snapkv", "adakv", "h2o"])
@pytest.mark.parametrize(("prefill", "padding"), [(99, "right"), (99, "left")])
def test_a_policys_own_compression_scores_rank_the_prompt_on_every_path(rule, prefill, padding):
    """Reference: the row loop, implementation: the fast path, both with ``rescore`` (a policy's own scores from
    the pooled ones and the protected tokens, here a fixed pattern over the slots plus the pooled scores): the
    prompt is compressed by the rescored values on both, and the rescored values are the state's scores."""
    import dataclasses

    query, key, value, chunk = make_chunk(3, 6, 2, 33, 0, RULES[rule], prefill, padding)

    def rescore(scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        pattern = torch.sin(torch.arange(scores.shape[-1], dtype=torch.float32) * 1.7)
        return scores + pattern.expand_as(scores) + protected.float()

    chunk = dataclasses.replace(chunk, rescore=rescore)
    expected = attend_chunk_reference(query, key, value, chunk)
    assert_same_result(attend_chunk(query, key, value, chunk), expected, chunk)
    plain = attend_chunk_reference(query, key, value, dataclasses.replace(chunk, rescore=None))
    assert not torch.equal(plain.held, expected.held), "the rescoring changed no kept token: the test proves nothing"


@pytest.mark.parametrize(("prefill", "padding"), [(99, "left"), (4, "right")])
def test_a_chunk_without_output_leaves_the_same_state(prefill, padding):
    """Reference: the fast path with ``output``; implementation: without it (a SharedPrompt pass, which attends
    itself): the same held slots, scores, capacities and kept counts. Prompt rows alone give no output at all;
    beside decode rows (``prefill=4``), theirs is zero and the decode rows' is the one computed with output."""
    import dataclasses

    query, key, value, chunk = make_chunk(3, 6, 2, 33, 0, RULES["h2o"], prefill, padding)
    expected = attend_chunk(query, key, value, chunk)
    result = attend_chunk(query, key, value, dataclasses.replace(chunk, output=False))
    assert torch.equal(result.held, expected.held) and torch.equal(result.kept, expected.kept)
    assert torch.equal(result.scores, expected.scores) and torch.equal(result.capacity, expected.capacity)
    if prefill > query.shape[2]:
        assert result.output is None
        return
    prompt = (torch.arange(query.shape[2]) < prefill).view(1, 1, -1, 1).expand_as(query)
    assert torch.equal(result.output[prompt], torch.zeros_like(result.output[prompt]))
    decoding = chunk.arriving.view(3, 1, -1, 1).expand_as(query) & ~prompt
    torch.testing.assert_close(result.output[decoding], expected.output[decoding])


def test_decode_rows_are_processed_in_blocks(monkeypatch):
    """Reference: the fast path with one block of rows; implementation: blocks of 8 rows (and of 5, which ends
    mid-chunk), so the scan's state (held slots, scores, entry and exit rows) crosses block boundaries."""
    import h2o_eval.chunks as chunks

    query, key, value, chunk = make_chunk(2, 6, 2, 40, 3, RULES["h2o"], 0, "left")
    whole = attend_chunk(query, key, value, chunk)
    for block in (8, 5):
        monkeypatch.setattr(chunks, "ROW_BLOCK", block)
        assert_same_result(attend_chunk(query, key, value, chunk), whole, chunk)


@pytest.mark.parametrize("rule", ["h2o", "tova_layer"])
def test_decode_blocks_compute_logits_only_for_the_slots_they_can_see(monkeypatch, rule):
    """Reference: attend_chunk_reference; implementation: the fast path in blocks of 8 rows, whose logits are
    computed against only the slots held when the block starts and its own 8 rows (an evicted token never
    returns): at most C + 8 columns of the 43 slots, per KV head or, with heads=layer, one set for the layer."""
    import h2o_eval.chunks as chunks

    query, key, value, chunk = make_chunk(2, 6, 2, 40, 3, RULES[rule], 0, "left")
    widths = []

    def scan_rows(logits, *args):
        widths.append(logits.shape[-1])
        return real_scan(logits, *args)

    real_scan = chunks.scan_rows
    monkeypatch.setattr(chunks, "scan_rows", scan_rows)
    monkeypatch.setattr(chunks, "ROW_BLOCK", 8)
    assert_same_result(attend_chunk(query, key, value, chunk), attend_chunk_reference(query, key, value, chunk), chunk)
    assert len(widths) == 5 and max(widths[1:]) <= int(chunk.capacity.max()) + 8


def one_hot_chunk(rows: list[list[float]], capacity: int, recent: int, rule: Rule = RULES["h2o"], prefill: int = 0):
    """One sequence, one head, keys = identity: row r's logits over the slots are exactly ``rows[r]``."""
    n = len(rows)
    query = torch.tensor(rows, dtype=torch.float32).view(1, 1, n, n)
    key = torch.eye(n).view(1, 1, n, n)
    value = torch.eye(n).view(1, 1, n, n)
    chunk = Chunk(
        held=torch.zeros(1, 1, n, dtype=torch.bool),
        arriving=torch.ones(1, n, dtype=torch.bool),
        position=torch.arange(n).view(1, 1, n),
        scores=torch.zeros(1, 1, n),
        capacity=torch.tensor([[capacity]]),
        recent=torch.tensor([recent]),
        sinks=torch.tensor([0]),
        prefill=torch.tensor([prefill]),
        rule=rule,
        scaling=1.0,
    )
    return query, key, value, chunk


@pytest.mark.parametrize("implementation", [attend_chunk, attend_chunk_reference])
def test_tova_ranks_by_the_layers_attention_and_keeps_one_token_set_per_layer(implementation):
    """Two KV heads of one query head each, capacity 2, recent 1 (the current token). At t1 head 0 attends all
    to token 0 and head 1 evenly to 0 and 1, so at t2 each head alone would evict a different token (head 0:
    1, scored 0; head 1: the older of a tie, 0). Summed over the layer's heads, 0 scores 1.5 and 1 scores 0.5:
    with heads="layer" both heads evict 1."""
    x = -1e4
    rows = {0: [[0, x, x], [0, x, x], [0, 0, 0]], 1: [[0, x, x], [0, 0, x], [0, 0, 0]]}
    query = torch.tensor([rows[0], rows[1]], dtype=torch.float32).unsqueeze(0)
    key = value = torch.eye(3).expand(1, 2, 3, 3)
    kept = {}
    for heads in ("layer", "kv"):
        chunk = Chunk(
            held=torch.zeros(1, 2, 3, dtype=torch.bool),
            arriving=torch.ones(1, 3, dtype=torch.bool),
            position=torch.arange(3).expand(1, 2, 3),
            scores=torch.zeros(1, 2, 3),
            capacity=torch.tensor([[2, 2]]),
            recent=torch.tensor([1]),
            sinks=torch.tensor([0]),
            prefill=torch.tensor([0]),
            rule=Rule(votes="all", combine="replace", heads=heads),
            scaling=1.0,
        )
        result = implementation(query, key, value, chunk)
        kept[heads] = result.held[0].tolist()
        if heads == "layer":  # t2 attends evenly to what it sees, 0 and itself, in both heads
            torch.testing.assert_close(result.scores[0, :, [0, 2]], torch.ones(2, 2))
    assert kept["layer"] == [[True, False, True], [True, False, True]]
    assert kept["kv"] == [[True, False, True], [False, True, True]]


@pytest.mark.parametrize("implementation", [attend_chunk, attend_chunk_reference])
def test_h2o_evicts_the_lowest_accumulated_score_outside_the_recent_window(implementation):
    """Capacity 3, recent 1 (the current token): two heavy slots. Logits of 0 and -inf make every
    probability exact, so the scores and evictions below are worked out by hand."""
    x = -1e4
    rows = [
        [0, x, x, x, x],  # t0 sees {0}: scores 0:1
        [0, 0, x, x, x],  # t1 sees {0,1}: 0:1.5 1:0.5
        [x, 0, 0, x, x],  # t2 sees {0,1,2} (logit of 0 is -inf): 0:1.5 1:1 2:0.5
        [0, x, x, 0, x],  # t3: full, evict min(0:1.5, 1:1, 2:0.5) = 2; sees {0,1,3}: 0:2 1:1 3:0.5
        [0, 0, 0, 0, 0],  # t4: evict min(0:2, 1:1, 3:0.5) = 3; sees {0,1,4}
    ]
    _, _, value, chunk = one_hot_chunk(rows, capacity=3, recent=1)
    query, key, _, _ = one_hot_chunk(rows, capacity=3, recent=1)
    result = implementation(query, key, value, chunk)
    output, held, scores = result.output, result.held, result.scores
    # value = identity, so the output row is the attention distribution itself.
    torch.testing.assert_close(output[0, 0, 3], torch.tensor([0.5, 0, 0, 0.5, 0]))
    torch.testing.assert_close(output[0, 0, 4], torch.tensor([1 / 3, 1 / 3, 0, 0, 1 / 3]))
    assert held[0, 0].tolist() == [True, True, False, False, True]
    torch.testing.assert_close(scores[0, 0, [0, 1, 4]], torch.tensor([2 + 1 / 3, 1 + 1 / 3, 1 / 3]))


@pytest.mark.parametrize("implementation", [attend_chunk, attend_chunk_reference])
def test_ties_evict_the_oldest_and_recent_tokens_are_never_evicted(implementation):
    """Uniform attention makes H2O scores tie often; capacity 3 with recent 2 leaves one heavy slot."""
    rows = [[0.0] * 6 for _ in range(6)]
    query, key, value, chunk = one_hot_chunk(rows, capacity=3, recent=2)
    causal = torch.ones(6, 6).tril().bool()
    query = query.masked_fill(~causal.view(1, 1, 6, 6), -1e4)
    held = implementation(query, key, value, chunk).held
    # t3 evicts among {0,1} (2 is recent): 0 has 1+1/2+1/3, 1 has 1/2+1/3 -> evict 1.
    # t4 evicts among {0,2}: 0 has 1+1/2+1/3+1/3, 2 has 1/3+1/3 -> 2. t5 evicts among {0,3}: 3.
    assert held[0, 0].tolist() == [True, False, False, False, True, True]


def test_local_keeps_a_sliding_window_and_tova_only_the_last_attention():
    rows = [[0.0] * 5 for _ in range(5)]
    query, key, value, chunk = one_hot_chunk(rows, capacity=2, recent=2, rule=RULES["static"])
    query = query.masked_fill(~torch.ones(5, 5).tril().bool().view(1, 1, 5, 5), -1e4)
    held = attend_chunk(query, key, value, chunk).held
    assert held[0, 0].tolist() == [False, False, False, True, True]
    x = -1e4
    tova_rows = [[0, x, x, x], [5, 0, x, x], [0, 5, 0, x], [0, 0, 0, 0]]
    query, key, value, chunk = one_hot_chunk(tova_rows, capacity=2, recent=1, rule=RULES["tova"])
    held = attend_chunk(query, key, value, chunk).held
    # t2 evicts the one t1 attended to least: 1 (0 got ~0.99). t2 then favours 1, which is gone: among
    # held {0,2} it attends 0 little (logit 0) vs 2 (logit 0): tie -> t3 evicts the older, 0.
    assert held[0, 0].tolist() == [False, False, True, True]


def test_h2o_reference_mask_worked_by_hand():
    """The authors' simulation, T=7, budget 4 tokens, heavy_ratio 0.5: hb = int(2.0) = 2 (top hb-1 = 1 heavy
    key besides the token), rb = int(2.0) = 2 (band t-2..t: rb+1 keys). Logits of 30 against 0 make the
    softmax rows (nearly) one-hot; rows 1 and 2 give key 0 a little: e^-3/(1+e^-3) and e^-4/(1+e^-4)."""
    t = 7
    logits = torch.zeros(1, t, t)
    for row, key, logit in [
        (0, 0, 30),
        (1, 1, 30),
        (1, 0, 27),
        (2, 2, 30),
        (2, 0, 26),
        (3, 2, 30),
        (4, 4, 30),
        (5, 4, 30),
        (6, 6, 30),
    ]:
        logits[0, row, key] = logit
    logits = logits.masked_fill(~torch.ones(t, t).tril().bool(), torch.finfo(torch.float32).min)
    keep = reference_keep_mask(logits, heavy_budget=2, recent_budget=2)[0]
    expected = [
        [0],  # rows < hb attend causally. Scores after rows 0, 1: key0 1.047, key1 0.953 (columns >= hb zeroed)
        [0, 1],
        [0, 1, 2],  # heavy: key0; band 0..2. Row 2's full softmax: key0 1.065, key1 0.953, key2 0.982;
        # only {0, 2} were kept by the heavy mask, so key1 is zeroed for good.
        [0, 1, 2, 3],  # heavy key0; band 1..3. Full softmax -> key2 (1.982 > key0!), but key2 is not in {0, 3}:
        # zeroed. Without the zeroing, key2 would be row 4's heavy hitter.
        [0, 2, 3, 4],  # heavy key0 (1.065); band 2..4; key4 scores 1.
        [0, 3, 4, 5],  # heavy key0 (1.065 > key4's 1.0); band 3..5; row 5 attends key4: zeroed (not in {0, 5}).
        [0, 4, 5, 6],
    ]
    assert [torch.nonzero(row).flatten().tolist() for row in keep] == expected


def test_h2o_reference_truncates_budgets_with_int():
    """budget 0.3 of T=9 with heavy_ratio 0.5: hb = int(1.35) = 1 -> no heavy keys beyond the token itself;
    rb = int(1.35) = 1 -> band t-1..t."""
    logits = torch.randn(2, 9, 9).masked_fill(~torch.ones(9, 9).tril().bool(), torch.finfo(torch.float32).min)
    keep = reference_keep_mask(logits, heavy_budget=int(9 * 0.3 * 0.5), recent_budget=int(9 * 0.3 * 0.5))
    band = torch.ones(9, 9).tril().triu(diagonal=-1).bool()
    band[0, 0] = True
    assert torch.equal(keep, band.expand(2, 9, 9))


def snapkv_rows() -> list[list[float]]:
    """10 prompt tokens; only the window rows 8 and 9 vote. Row 8 attends keys {2, 8} equally, row 9 keys
    {5, 6, 9}; the other rows attend to themselves. Raw votes of positions 0..7: key 2 gets 1/2, keys 5 and 6
    get 1/3 each, the rest 0."""
    x = -1e4
    rows = [[0.0 if j == i else x for j in range(10)] for i in range(10)]
    rows[8] = [0.0 if j in (2, 8) else x for j in range(10)]
    rows[9] = [0.0 if j in (5, 6, 9) else x for j in range(10)]
    return rows


@pytest.mark.parametrize(
    ("pooling", "kernel_size", "kept"),
    [
        # No pooling: the top 3 of positions 0..7 are 2 (1/2), 5 and 6 (1/3).
        (None, 1, [2, 5, 6, 8, 9]),
        # Max pool, kernel 3: [0, 1/2, 1/2, 1/2, 1/3, 1/3, 1/3, 1/3]: three ties at 1/2 keep 1, 2, 3.
        ("max", 3, [1, 2, 3, 8, 9]),
        # Avg pool, kernel 3, zero padding counted: [0, 1/6, 1/6, 1/6, 1/9, 2/9, 2/9, 1/9]: 5 and 6 (2/9), then of
        # the 1/6 ties the newest, 3 (the oldest go first).
        ("avg", 3, [3, 5, 6, 8, 9]),
    ],
)
@pytest.mark.parametrize("implementation", [attend_chunk, attend_chunk_reference])
def test_snapkv_window_votes_are_pooled_then_the_top_positions_kept(implementation, pooling, kernel_size, kept):
    """SnapKV worked by hand: prompt of 10, window 2, C = 5 keeps the window plus the top 3 of the pooled votes."""
    rule = Rule(votes="window", window=2, pooling=pooling, kernel_size=kernel_size, grows=True)
    query, key, value, chunk = one_hot_chunk(snapkv_rows(), capacity=5, recent=2, rule=rule, prefill=10)
    result = implementation(query, key, value, chunk)
    assert torch.nonzero(result.held[0, 0]).flatten().tolist() == kept
    assert result.capacity.item() == UNBOUNDED and result.kept.item() == 5


def test_pooling_matches_torch_on_each_heads_positions():
    """pool_scores against torch's own max_pool1d / avg_pool1d run on each (sequence, head)'s domain alone; the
    domains have different lengths, and scores outside them are left as they are."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 3, 12, generator=gen)
    domain = torch.zeros(2, 3, 12, dtype=torch.bool)
    for b, h, stop in [(0, 0, 9), (0, 1, 12), (0, 2, 1), (1, 0, 4), (1, 1, 7), (1, 2, 0)]:
        domain[b, h, 2 : 2 + stop] = True
    for pooling, pool in (("max", torch.nn.functional.max_pool1d), ("avg", torch.nn.functional.avg_pool1d)):
        got = pool_scores(scores, domain, Rule(pooling=pooling, kernel_size=5))
        for b, h in itertools.product(range(2), range(3)):
            where = domain[b, h]
            if where.any():
                expected = pool(scores[b, h, where].view(1, 1, -1), 5, stride=1, padding=2).flatten()
                torch.testing.assert_close(got[b, h, where], expected)
            assert torch.equal(got[b, h, ~where], scores[b, h, ~where])


def ada_scores() -> tuple[torch.Tensor, ...]:
    """One sequence, 2 KV heads, 5 prompt tokens, the last (position 4) protected. Head 0's candidates score
    0.9, 0.8, 0.7, 0.1; head 1's 0.05, 0.04, 0.3, 0.2."""
    scores = torch.tensor([[[0.9, 0.8, 0.7, 0.1, 0.0], [0.05, 0.04, 0.3, 0.2, 0.0]]])
    held = torch.ones(1, 2, 5, dtype=torch.bool)
    position = torch.arange(5).expand(1, 2, 5)
    return held, scores, position


@pytest.mark.parametrize(
    ("alpha", "kept"),
    [
        # C = 3 per head: 6 slots in the layer, 2 protected. Safeguard floor(0.2 * 3) = 0: the 4 shared slots go to
        # the best of the layer, 0.9, 0.8, 0.7 (head 0) and 0.3 (head 1).
        (0.2, [[0, 1, 2, 4], [2, 4]]),
        # floor(0.7 * 3) = 2 per head, the protected token included: 0.9 and 0.3 guaranteed; the 2 left go to
        # 0.8 and 0.7.
        (0.7, [[0, 1, 2, 4], [2, 4]]),
        # floor(1.0 * 3) = 3: each head keeps its own best 2, as without Ada-KV.
        (1.0, [[0, 1, 4], [2, 3, 4]]),
    ],
)
def test_adakv_shares_the_layers_slots_with_a_safeguard(alpha, kept):
    held, scores, position = ada_scores()
    rule = Rule(safeguard=alpha)
    result, _, after = compress(
        held, scores, position, torch.tensor([[3, 3]]), torch.tensor([1]), torch.tensor([0]), torch.tensor([4]), rule
    )
    assert [torch.nonzero(result[0, h]).flatten().tolist() for h in range(2)] == kept
    assert after.tolist() == [[len(kept[0]), len(kept[1])]]


def test_adakv_compression_of_the_fast_path_equals_the_reference():
    """The hand-worked layer above as a prompt chunk (scores given, as key scores would be): the reference's
    single evictions across heads agree with the vectorised compression, for each safeguard."""
    held, scores, position = ada_scores()
    for alpha in (0.2, 0.7, 1.0):
        chunk = Chunk(
            held=torch.zeros_like(held),
            arriving=torch.ones(1, 5, dtype=torch.bool),
            position=position.contiguous(),
            scores=scores,
            capacity=torch.tensor([[3, 3]]),
            recent=torch.tensor([1]),
            sinks=torch.tensor([0]),
            prefill=torch.tensor([5]),
            rule=Rule(safeguard=alpha),
            scaling=1.0,
        )
        query, key, value = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
        expected = attend_chunk_reference(query, key, value, chunk)
        assert_same_result(attend_chunk(query, key, value, chunk), expected, chunk)


def test_prompt_rows_after_the_cache_holds_tokens_are_refused():
    query, key, value, chunk = make_chunk(1, 4, 4, 5, 3, RULES["h2o"], 0, "none")
    chunk.prefill = torch.tensor([2])
    for implementation in (attend_chunk, attend_chunk_reference):
        with pytest.raises(ValueError, match="prompt rows need an empty cache"):
            implementation(query, key, value, chunk)
