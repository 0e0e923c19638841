"""Paired statistics on hand-made outcomes whose answers are known, and the simulation that calibrates the
primary test."""

import itertools
from functools import partial
from math import comb

import numpy as np
import pytest

from h2o_eval import results, stats


def mid_p_mcnemar(only_a: int, only_b: int) -> float:
    """McNemar's mid-p from its textbook formula: twice the smaller binomial tail minus half the point mass."""
    n, k = only_a + only_b, min(only_a, only_b)
    tail = sum(comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * (tail - comb(n, k) / 2**n / 2)) if n else 1.0


def brute_force_mid_p(totals: list[float]) -> float:
    """The sign-flip mid-p by enumerating every sign pattern of the documents' summed differences."""
    observed = abs(sum(totals))
    sums = np.array([abs(np.dot(signs, totals)) for signs in itertools.product([-1, 1], repeat=len(totals))])
    above, equal = np.mean(sums > observed + 1e-9), np.mean(np.abs(sums - observed) <= 1e-9)
    return min(1.0, above + equal / 2)


def test_identical_outcomes_give_a_zero_width_interval_p_one_and_say_nothing_can_be_significant():
    a = [1, 0, 1, 1, 0, 1, 0, 0]
    result = stats.paired(a, list(a))
    assert (result.difference, result.low, result.high) == (0.0, 0.0, 0.0)
    assert result.test.p == 1.0
    assert not result.significant and not result.test.decidable


@pytest.mark.parametrize(("only_a", "only_b"), [(7, 1), (10, 0), (3, 3), (12, 5), (5, 0), (4, 0)])
def test_one_question_per_document_of_0_1_scores_is_mcnemars_mid_p_test(only_a, only_b):
    agree = 20
    a = [1] * only_a + [0] * only_b + [1] * agree + [0] * agree
    b = [0] * only_a + [1] * only_b + [1] * agree + [0] * agree
    test = stats.paired(a, b).test
    assert test.name == "McNemar mid-p"
    assert test.p == pytest.approx(mid_p_mcnemar(only_a, only_b), rel=1e-9)
    assert test.min_p == 2.0 ** -(only_a + only_b)  # every discordant pair on one side
    assert test.significant == (test.p < 0.05)


def test_five_discordant_pairs_on_one_side_are_significant_and_four_cannot_be():
    assert stats.paired([1] * 5 + [0] * 30, [0] * 35).significant  # mid-p 1/32
    four = stats.paired([1] * 4 + [0] * 30, [0] * 34)
    assert four.test.p == pytest.approx(1 / 16) and not four.test.decidable


@pytest.mark.parametrize(
    "totals", [[2, -1, 3, 1, 1, -2, 0.5, 0.25, 2], [4, 4, -4, 4, 3, 4, 0, 4], [0.1, 0.3, -0.2, 0.7, 0.1, 0.1]]
)
def test_the_exact_document_sign_flip_distribution_equals_enumerating_every_sign_pattern(totals):
    a = list(totals)  # one question per document: its summed difference is the question's
    test = stats.primary_test(a, [0.0] * len(a))
    assert test.name == "sign-flip by document"
    assert test.p == pytest.approx(brute_force_mid_p(totals), abs=1e-12)


def test_continuous_scores_are_tested_by_every_sign_pattern_or_by_drawn_sign_flips():
    rng = np.random.default_rng(4)
    a, b = rng.random(12), rng.random(12)  # on no grid; 2^12 sign patterns are enumerated
    test = stats.primary_test(a, b)
    assert test.name == "sign-flip by document"
    assert test.p == pytest.approx(brute_force_mid_p((a - b).tolist()), abs=1e-9)
    a, b = rng.random(300) + 0.05, rng.random(300)
    many = stats.primary_test(a, b)
    assert many.name == f"sign-flip by document ({stats.FLIPS:,} draws)" and many.min_p == 1 / (stats.FLIPS + 1)
    flips = np.random.default_rng(9).choice([-1.0, 1.0], (20_000, 300))  # an independent draw of the same null
    assert many.p == pytest.approx(np.mean(np.abs(flips @ (a - b)) >= abs(np.sum(a - b))), abs=0.01)


def test_a_constant_shift_on_four_documents_has_the_shift_as_its_interval_but_no_verdict():
    a = [0.5, 0.25, 0.75, 0.1]
    result = stats.paired(a, [x - 0.1 for x in a])
    assert result.difference == pytest.approx(0.1)
    assert (result.low, result.high) == pytest.approx((0.1, 0.1))  # the interval alone would call it certain
    assert result.test.p == pytest.approx(1 / 16) and not result.significant and not result.test.decidable


def test_the_interval_is_the_percentiles_of_resampled_mean_differences():
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 2, 60), rng.integers(0, 2, 60)
    result = stats.paired(a.tolist(), b.tolist(), resamples=2000, seed=3)
    # the same resampling by hand: indices drawn with the seeded generator, one row per resample
    d = (a - b).astype(float)
    means = d[np.random.default_rng(3).integers(0, d.size, (2000, d.size))].mean(axis=1)
    assert result.difference == pytest.approx(d.mean())
    assert (result.low, result.high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])), abs=1 / 60)
    assert stats.paired(a.tolist(), b.tolist(), resamples=2000, seed=3) == result  # seeded: the same interval


def test_a_clear_difference_is_significant_and_noise_is_not():
    a = [1] * 80 + [0] * 20
    assert stats.paired(a, [0] * 60 + [1] * 40).significant  # 0.8 against 0.4 on 100 documents
    assert not stats.paired([1, 0] * 50, [0, 1] * 50).significant  # equal means, every pair discordant


def test_correlated_questions_widen_the_document_bootstrap_and_weaken_the_test():
    """Four questions per document that always agree: as informative as one question per document, which the
    document-level interval and test see and a per-question one does not."""
    per_document = np.array([1.0] * 10 + [-1.0] * 3 + [0.0] * 17)  # a wins on 10 documents, b on 3
    a = np.repeat(np.maximum(per_document, 0), 4)
    b = np.repeat(np.maximum(-per_document, 0), 4)
    documents = np.repeat([f"doc{i}" for i in range(30)], 4)
    naive, clustered = stats.paired(a, b), stats.paired(a, b, documents)
    assert clustered.difference == naive.difference
    assert (clustered.n, clustered.documents, naive.documents) == (120, 30, 120)
    assert clustered.clustered and not naive.clustered
    assert clustered.high - clustered.low > 1.6 * (naive.high - naive.low)  # about sqrt(4) = 2 times wider
    assert clustered.test.name == "sign-flip by document"  # not McNemar: the questions are not independent
    assert clustered.test.p > 2 * naive.test.p
    assert clustered.test.p == pytest.approx(brute_force_mid_p([4.0 * d for d in per_document if d]), abs=1e-12)


def test_the_mean_over_tasks_resamples_within_each_task():
    copa = ([1] * 10, [0] * 10)  # +1 everywhere
    piqa = ([0.0] * 30, [0.0] * 30)  # 0 everywhere
    result = stats.paired_mean([copa, piqa])
    assert (result.difference, result.low, result.high) == (0.5, 0.5, 0.5)  # each task keeps its weight
    assert result.n == 40
    assert result.test.p == pytest.approx(2.0**-10)  # copa's ten documents, flipped within copa
    mixed = stats.paired_mean([([1, 0] * 20, [0] * 40), ([0] * 30, [0] * 30)])
    assert mixed.difference == pytest.approx(0.25)
    assert mixed.low < 0.25 < mixed.high


def test_a_score_and_a_mean_over_tasks_get_document_bootstrap_intervals():
    halves = [1.0, 0.0] * 10
    alone = stats.estimate(halves, seed=5)
    assert (alone.value, alone.n, alone.documents) == (0.5, 20, 20)
    assert alone.low < 0.5 < alone.high
    # a task scoring 1 everywhere adds no width: the mean is (halves + 1) / 2, resample by resample
    mean = stats.mean_over_tasks([(halves, None), ([1.0] * 7, None)], seed=5)
    assert (mean.value, mean.n, mean.documents) == (0.75, 27, 27)
    assert (mean.low, mean.high) == pytest.approx(((alone.low + 1) / 2, (alone.high + 1) / 2))
    # a document's questions are resampled together, and the score is per question, not per document
    clustered = stats.estimate([1.0, 1.0, 1.0, 0.0], ["d0", "d0", "d0", "d1"])
    assert (clustered.value, clustered.documents) == (0.75, 2)
    assert clustered.low == pytest.approx(0.0) and clustered.high == pytest.approx(1.0)


def test_unequal_or_empty_pairs_are_refused():
    with pytest.raises(ValueError, match="equally long"):
        stats.paired([1, 0], [1])
    with pytest.raises(ValueError, match="equally long"):
        stats.paired([], [])
    with pytest.raises(ValueError, match="documents name 1 questions' documents for 2 scores"):
        stats.paired([1, 0], [0, 0], ["d0"])


def test_align_pairs_questions_by_id_with_their_documents_and_refuses_other_ones():
    a = {"b": ("d1", 1.0), "a": ("d0", 0.0)}
    assert stats.align(a, {"a": ("d0", 1.0), "b": ("d1", 1.0)}) == ([0.0, 1.0], [1.0, 1.0], ["d0", "d1"])
    assert stats.align({"a": ("a", 1.0)}, {"b": ("b", 1.0)}) is None  # other questions
    assert stats.align(a, {"a": ("d0", 1.0), "b": ("d0", 1.0)}) is None  # the same ids in other documents


def test_question_scores_read_each_rows_document_and_default_to_the_question_itself(tmp_path):
    rows = [
        {"id": "12/0", "document": 12, "scores": {"string_match_all": 1.0}},
        {"id": "12/1", "document": 12, "scores": {"string_match_all": 0.5}},
    ]
    results.write_jsonl(tmp_path / "r.outputs.jsonl", rows)
    results.write_jsonl(tmp_path / "old.outputs.jsonl", [{"id": 3, "scores": {"acc": 1.0}}])
    assert stats.question_scores({"outputs": "r.outputs.jsonl"}, tmp_path, "string_match_all") == {
        "12/0": (12, 1.0),
        "12/1": (12, 0.5),
    }
    assert stats.question_scores({"outputs": "old.outputs.jsonl"}, tmp_path, "acc") == {3: (3, 1.0)}
    assert stats.question_scores({"outputs": "old.outputs.jsonl"}, tmp_path, "rouge2") == {}
    assert stats.document_scores({"outputs": "r.outputs.jsonl"}, tmp_path, "string_match_all") == {
        "12/0": 1.0,
        "12/1": 0.5,
    }
    assert stats.document_scores({}, tmp_path, "acc") is None


def test_the_primary_metric_of_a_record():
    assert stats.primary_metric({"metric": "rouge2", "metrics": {}}) == "rouge2"
    assert stats.primary_metric({"length": 4096, "metrics": {"string_match_part": 0.5}}) == "string_match_part"
    assert stats.primary_metric({"length": 4096, "metrics": {"string_match_all": 0.5}}) == "string_match_all"
    assert stats.primary_metric({"metrics": {"acc": 0.5}}) == "acc"


def test_simulated_pairs_have_the_stated_discordance_and_difference():
    rng = np.random.default_rng(1)
    a, b = stats.simulated_pairs(rng, 200_000, 0.3, 0.1)
    assert np.mean(a != b) == pytest.approx(0.3, abs=0.005)
    assert np.mean(a - b) == pytest.approx(0.1, abs=0.005)
    assert np.mean((a == 1) & (b == 1)) == pytest.approx(0.35, abs=0.005)


def exact_false_positive_rate(n: int, discordant: float) -> float:
    """The mid-p McNemar test's false-positive rate computed exactly: over the number k of discordant pairs
    (binomial in n) and the split of those k (binomial in k, one half)."""
    rate = 0.0
    for k in range(n + 1):
        p_k = comb(n, k) * discordant**k * (1 - discordant) ** (n - k)
        rate += p_k * sum(comb(k, j) / 2**k for j in range(k + 1) if mid_p_mcnemar(j, k - j) < 0.05)
    return rate


@pytest.mark.slow
@pytest.mark.parametrize("n", [20, 50, 100])
def test_the_primary_tests_false_positive_rate_is_at_most_about_6_percent(n):
    """4,000 seeded draws per setting: a standard error of 0.35 points at 5 %, so a test whose true rate were 6.5 %
    would fail. The simulated rate also matches the rate computed exactly from the binomial distribution."""
    draws = 4000

    def rejects(a, b):
        return stats.primary_test(a, b).significant

    for discordant in (0.15, 0.30):
        null, shifted = (partial(stats.simulated_pairs, n=n, discordant=discordant, difference=d) for d in (0, 0.1))
        rate = stats.rejection_rate(rejects, null, draws, seed=n)
        exact = exact_false_positive_rate(n, discordant)
        assert rate <= 0.06
        assert abs(rate - exact) < 4 * np.sqrt(exact * (1 - exact) / draws) + 1e-3
        power = stats.rejection_rate(rejects, shifted, 1000, seed=n)
        print(f"n={n} discordant={discordant:.0%}: false positives {rate:.3f} (exact {exact:.3f}), power {power:.3f}")
    assert power > {20: 0.05, 50: 0.15, 100: 0.35}[n]  # at 30 % discordant: the test is not blind
