"""Paired statistics on hand-made outcomes whose answers are known."""

from math import comb

import numpy as np
import pytest

from h2o_eval import stats


def test_identical_outcomes_give_a_zero_width_interval_and_p_one():
    a = [1, 0, 1, 1, 0, 1, 0, 0]
    result = stats.paired(a, list(a))
    assert (result.difference, result.low, result.high) == (0.0, 0.0, 0.0)
    assert result.p_mcnemar == 1.0
    assert not result.significant


@pytest.mark.parametrize(("only_a", "only_b"), [(7, 1), (10, 0), (3, 3), (12, 5)])
def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_pairs(only_a, only_b):
    agree = 20
    a = [1] * only_a + [0] * only_b + [1] * agree + [0] * agree
    b = [0] * only_a + [1] * only_b + [1] * agree + [0] * agree
    n = only_a + only_b
    tail = sum(comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    assert stats.paired(a, b).p_mcnemar == pytest.approx(min(1.0, 2 * tail), rel=1e-12)


def test_a_constant_shift_has_the_shift_as_its_interval():
    a = [0.5, 0.25, 0.75, 0.1]
    result = stats.paired(a, [x - 0.1 for x in a])
    assert result.difference == pytest.approx(0.1)
    assert (result.low, result.high) == pytest.approx((0.1, 0.1))
    assert result.p_mcnemar is None  # not 0/1 outcomes
    assert result.significant


def test_the_interval_is_the_percentiles_of_resampled_mean_differences():
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 2, 60), rng.integers(0, 2, 60)
    result = stats.paired(a.tolist(), b.tolist(), resamples=2000, seed=3)
    # the same resampling by hand: scipy draws indices with the seeded generator, one row per resample
    d = (a - b).astype(float)
    means = d[np.random.default_rng(3).integers(0, d.size, (2000, d.size))].mean(axis=1)
    assert result.difference == pytest.approx(d.mean())
    assert (result.low, result.high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])), abs=1 / 60)
    assert stats.paired(a.tolist(), b.tolist(), resamples=2000, seed=3) == result  # seeded: the same interval


def test_a_clear_difference_is_significant_and_noise_is_not():
    a = [1] * 80 + [0] * 20
    assert stats.paired(a, [0] * 60 + [1] * 40).significant  # 0.8 against 0.4 on 100 documents
    assert not stats.paired([1, 0] * 50, [0, 1] * 50).significant  # equal means, every pair discordant


def test_the_mean_over_tasks_resamples_within_each_task():
    copa = ([1] * 10, [0] * 10)  # +1 everywhere
    piqa = ([0.0] * 30, [0.0] * 30)  # 0 everywhere
    result = stats.paired_mean([copa, piqa])
    assert (result.difference, result.low, result.high) == (0.5, 0.5, 0.5)  # each task keeps its weight
    assert result.n == 40
    mixed = stats.paired_mean([([1, 0] * 20, [0] * 40), ([0] * 30, [0] * 30)])
    assert mixed.difference == pytest.approx(0.25)
    assert mixed.low < 0.25 < mixed.high


def test_unequal_or_empty_pairs_are_refused():
    with pytest.raises(ValueError, match="equally long"):
        stats.paired([1, 0], [1])
    with pytest.raises(ValueError, match="equally long"):
        stats.paired([], [])


def test_align_pairs_documents_by_id_and_refuses_different_documents():
    assert stats.align({"b": 1.0, "a": 0.0}, {"a": 1.0, "b": 1.0}) == ([0.0, 1.0], [1.0, 1.0])
    assert stats.align({"a": 1.0}, {"b": 1.0}) is None
