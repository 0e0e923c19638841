"""The mechanism itself: the compiled scan against the plain row loop, and hand-worked examples."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_chunk

from h2o_eval.backend import reference_keep_mask
from h2o_eval.eviction import Chunk, attend_chunk, attend_chunk_reference
from h2o_eval.policies import ScoreRule

GRID = list(
    itertools.product(
        [1, 3],  # batch
        [(4, 4), (6, 2), (8, 2)],  # (query heads, KV heads): GQA ratios 1, 3, 4
        [1, 7, 33],  # new tokens
        [0, 5],  # state slots
        list(ScoreRule),
    )
)


@pytest.mark.parametrize(("batch", "heads", "n", "state", "rule"), GRID)
@pytest.mark.parametrize(("prefill", "padding"), [(0, "none"), (0, "left"), (4, "right"), (99, "left"), (99, "right")])
def test_compiled_scan_equals_the_row_loop(batch, heads, n, state, rule, prefill, padding):
    """Reference: attend_chunk_reference (torch loop over rows); implementation: attend_chunk (numba scan)."""
    query, key, value, chunk = make_chunk(batch, *heads, n, state, rule, prefill, padding)
    out_ref, held_ref, scores_ref = attend_chunk_reference(query, key, value, chunk)
    out, held, scores = attend_chunk(query, key, value, chunk)
    rows = chunk.arriving.view(batch, 1, n, 1).expand_as(out)
    torch.testing.assert_close(out[rows], out_ref[rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(held, held_ref)
    torch.testing.assert_close(scores[held], scores_ref[held], rtol=1e-5, atol=1e-6)
    capacity = chunk.capacity.view(-1, 1)
    assert (held.sum(-1) <= torch.maximum(capacity, torch.tensor(state))).all()


def one_hot_chunk(rows: list[list[float]], capacity: int, recent: int, rule: ScoreRule = ScoreRule.ACCUMULATE):
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
        capacity=torch.tensor([capacity]),
        recent=torch.tensor([recent]),
        sinks=torch.tensor([0]),
        prefill=torch.tensor([0]),
        rule=rule,
        scaling=1.0,
    )
    return query, key, value, chunk


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
    output, held, scores = implementation(query, key, value, chunk)
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
    _, held, scores = implementation(query, key, value, chunk)
    # t3 evicts among {0,1} (2 is recent): 0 has 1+1/2+1/3, 1 has 1/2+1/3 -> evict 1.
    # t4 evicts among {0,2}: 0 has 1+1/2+1/3+1/3, 2 has 1/3+1/3 -> 2. t5 evicts among {0,3}: 3.
    assert held[0, 0].tolist() == [True, False, False, False, True, True]


def test_local_keeps_a_sliding_window_and_tova_only_the_last_attention():
    rows = [[0.0] * 5 for _ in range(5)]
    query, key, value, chunk = one_hot_chunk(rows, capacity=2, recent=2, rule=ScoreRule.NONE)
    query = query.masked_fill(~torch.ones(5, 5).tril().bool().view(1, 1, 5, 5), -1e4)
    _, held, _ = attend_chunk(query, key, value, chunk)
    assert held[0, 0].tolist() == [False, False, False, True, True]
    x = -1e4
    tova_rows = [[0, x, x, x], [5, 0, x, x], [0, 5, 0, x], [0, 0, 0, 0]]
    query, key, value, chunk = one_hot_chunk(tova_rows, capacity=2, recent=1, rule=ScoreRule.CURRENT)
    _, held, _ = attend_chunk(query, key, value, chunk)
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
