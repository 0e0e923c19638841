"""Statistics of runs scored on the same documents, with a known false-positive rate.

    python -m h2o_eval.stats [--draws 4000] [--seed 0]

prints the simulation that chose the primary test (below): its false-positive rate with no true difference and
its power on a true 10-point difference, beside the alternatives it was chosen over.

Every policy is scored on the documents the full cache was scored on, so a difference between two runs is read
pair by pair. A document may carry several questions (long-context haystacks answering K questions); its
questions are not independent, so the document, not the question, is the unit that is resampled or flipped:

- **Primary test (the verdict):** a two-sided paired sign-flip permutation test of the mean difference that
  flips each document's summed difference as one unit, with the mid-p correction for discreteness. For 0/1
  scores with one question per document it is McNemar's mid-p test (Fagerland, Lydersen & Laake 2013, BMC Med
  Res Methodol 13:91). The null distribution is exact where the differences lie on a grid (0/1 and fractional
  scores); otherwise (ROUGE) it is drawn by 10,000 seeded sign flips (:func:`scipy.stats.permutation_test`).
  Chosen by simulation: exact McNemar keeps its 5 % but wastes power (false-positive rate 0.2-3 % at n = 20-100
  with 15-30 % discordant pairs), the percentile bootstrap reaches 6 % at n = 20 and 9-13 % on continuous scores
  at n = 10-20; the mid-p test stays at or below 5 % there.
- **Secondary:** the mean difference's percentile bootstrap interval (seeded, 10,000 resamples) resampling
  documents with all their questions; a mean over tasks resamples documents within each task, so each task keeps
  its weight.

A score (not a difference) gets the same document-bootstrap interval (:func:`estimate`), and so does the
unweighted mean of several tasks' scores (:func:`mean_over_tasks`).

Per-question scores live in a record's outputs file (``<record>.outputs.jsonl``): one row per question with its
``id``, its ``scores`` (metric name to value) and, when a document carries several questions, its ``document``;
a row without ``document`` is a document of its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from h2o_eval import packs

RESAMPLES = 10_000
FLIPS = 10_000
SEED = 0
LEVEL = 0.95
ALPHA = 0.05
LONG_CONTEXT_METRICS = ("string_match_all", "string_match_part")
_ZERO = 1e-12  # a difference smaller than this is a tie (float noise of equal scores)
_MAX_GRID = 64  # finest grid (1/64 of the smallest difference) searched for an exact null distribution
_MAX_SUPPORT = 200_000  # widest exact null distribution computed; wider ones are drawn


@dataclass(frozen=True)
class Verdict:
    """The primary test's verdict on one comparison: its two-sided ``p``, the test's ``name``, and ``min_p``,
    the smallest p-value any outcome on these documents could give (at or above ``ALPHA`` nothing can be
    significant: too few documents differ)."""

    p: float
    name: str
    min_p: float

    @property
    def significant(self) -> bool:
        return self.p < ALPHA

    @property
    def decidable(self) -> bool:
        """Whether p < ``ALPHA`` is possible at all on these documents."""
        return self.min_p < ALPHA


@dataclass(frozen=True)
class Paired:
    """``a`` against ``b`` on the same ``n`` questions of ``documents`` documents: ``difference`` =
    mean(a) − mean(b) over questions, its document-bootstrap interval [``low``, ``high``] (secondary), and the
    primary ``test``, whose verdict :attr:`significant` is."""

    n: int
    documents: int
    difference: float
    low: float
    high: float
    test: Verdict

    @property
    def significant(self) -> bool:
        """The primary test rejects no difference at ``ALPHA``."""
        return self.test.significant

    @property
    def clustered(self) -> bool:
        """Some document carries several questions (so a per-question McNemar test would not be valid)."""
        return self.documents < self.n


@dataclass(frozen=True)
class Estimate:
    """A mean score over ``n`` questions of ``documents`` documents (or the unweighted mean of several tasks'
    scores) and its document-bootstrap interval [``low``, ``high``]."""

    n: int
    documents: int
    value: float
    low: float
    high: float


def _documents(documents: Sequence[Any] | None, n: int) -> np.ndarray:
    """Each question's document as an index 0..m-1; without ``documents`` every question is its own."""
    if documents is None:
        return np.arange(n)
    if len(documents) != n:
        raise ValueError(f"documents name {len(documents)} questions' documents for {n} scores")
    return np.unique(np.asarray([str(d) for d in documents]), return_inverse=True)[1].reshape(-1)


def _totals(values: np.ndarray, documents: Sequence[Any] | None) -> tuple[np.ndarray, np.ndarray]:
    """Per document: the sum of its questions' values and its number of questions."""
    index = _documents(documents, values.size)
    return np.bincount(index, weights=values), np.bincount(index).astype(float)


def _bootstrap(strata: list[tuple[np.ndarray, np.ndarray]], resamples: int, seed: int) -> tuple[float, float, float]:
    """The unweighted mean over strata (tasks) of each stratum's per-question mean, sum(totals) / sum(counts),
    and its percentile interval from resampling each stratum's documents (totals with their counts) with
    replacement, independently per stratum."""
    point = float(np.mean([totals.sum() / counts.sum() for totals, counts in strata]))
    if all(np.allclose(totals / counts, totals[0] / counts[0], rtol=0, atol=_ZERO) for totals, counts in strata):
        return point, point, point  # nothing varies: every resample is the point
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for totals, counts in strata:
        chunk = max(1, 2_000_000 // totals.size)  # bounds the index matrix's memory
        for start in range(0, resamples, chunk):
            index = rng.integers(0, totals.size, (min(chunk, resamples - start), totals.size))
            means[start : start + index.shape[0]] += totals[index].sum(axis=1) / counts[index].sum(axis=1)
    means /= len(strata)
    low, high = np.percentile(means, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
    return point, float(low), float(high)


def _grid(magnitudes: np.ndarray) -> np.ndarray | None:
    """The positive ``magnitudes`` as integers on a common grid (a fraction 1/L, L <= 64, of the smallest),
    or None when they lie on no such grid or the exact distribution would be too wide."""
    scaled = magnitudes / magnitudes.min()
    for steps in range(1, _MAX_GRID + 1):
        grid = scaled * steps
        if np.all(np.abs(grid - np.rint(grid)) < 1e-6 * steps) and grid.sum() <= _MAX_SUPPORT:
            return np.rint(grid).astype(np.int64)
        if grid.sum() > _MAX_SUPPORT:
            return None
    return None


def _sign_flip_distribution(magnitudes: np.ndarray) -> np.ndarray:
    """The exact distribution of sum(±m) over independent fair signs of the integer ``magnitudes``, as
    probabilities of the values -S..S (S = sum of the magnitudes): documents of one magnitude m and count c add
    m·(2k − c) with k ~ Binomial(c, 1/2)."""
    from scipy.special import gammaln

    distribution, width = np.ones(1), 0
    values, counts = np.unique(magnitudes, return_counts=True)
    for value, count in zip(values.tolist(), counts.tolist(), strict=True):
        k = np.arange(count + 1)
        binomial = np.exp(gammaln(count + 1) - gammaln(k + 1) - gammaln(count - k + 1) - count * np.log(2))
        wider = width + value * count
        new = np.zeros(2 * wider + 1)
        if width == 0:
            new[:: 2 * value] = binomial
        else:
            for k, probability in enumerate(binomial):
                start = value * 2 * k  # the offset of sum −width + m·(2k − c) on the new −wider..wider axis
                new[start : start + 2 * width + 1] += probability * distribution
        distribution, width = new, wider
    return distribution


def _sign_flip(contributions: np.ndarray, seed: int) -> tuple[float, bool, float]:
    """Two-sided sign-flip test that the ``contributions`` (each document's share of the statistic, their sum)
    are symmetric about zero: the mid-p value, whether its null distribution is exact (on a grid, or every sign
    pattern enumerated when few documents differ), and the smallest p-value any signs could give."""
    differing = contributions[np.abs(contributions) > _ZERO]
    if not differing.size:
        return 1.0, True, 1.0
    grid = _grid(np.abs(differing))
    if grid is None:
        from scipy.stats import permutation_test

        result = permutation_test(
            (differing,),
            lambda x, axis: np.sum(x, axis=axis),
            permutation_type="samples",
            n_resamples=FLIPS,
            vectorized=True,
            rng=np.random.default_rng(seed),
        )
        if result.null_distribution.size < 2**differing.size:  # drawn: scipy's conservative p
            return float(result.pvalue), False, 1 / (FLIPS + 1)
        null, observed = result.null_distribution, abs(result.statistic)  # every sign pattern, once
        tie = np.isclose(null, observed, rtol=1e-9, atol=0)
        p = min(1.0, 2 * (np.mean((null > observed) & ~tie) + 0.5 * np.mean(tie)))
        return float(p), True, 2.0**-differing.size
    distribution = _sign_flip_distribution(grid)
    width = distribution.size // 2
    observed = abs(int(np.sum(np.sign(differing) * grid)))
    above = distribution[width + observed + 1 :].sum()
    p = min(1.0, 2 * (above + 0.5 * distribution[width + observed]))
    return float(p), True, 2.0**-differing.size


def _binary(values: np.ndarray) -> bool:
    return bool(np.all((values == 0) | (values == 1)))


def _pair(a: Sequence[float], b: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    a_, b_ = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a_.shape != b_.shape or a_.ndim != 1 or not a_.size:
        raise ValueError(f"paired scores need two equally long, non-empty lists (got {a_.shape} and {b_.shape})")
    return a_, b_


def primary_test(
    a: Sequence[float], b: Sequence[float], documents: Sequence[Any] | None = None, *, seed: int = SEED
) -> Verdict:
    """The primary test of ``a`` against ``b`` (per-question scores in one order, ``documents`` naming each
    question's document): the sign-flip permutation test by document (mid-p), named McNemar's mid-p test where
    it is one (0/1 scores, one question per document)."""
    a_, b_ = _pair(a, b)
    totals, counts = _totals(a_ - b_, documents)
    p, exact, min_p = _sign_flip(totals, seed)
    if not exact:
        name = f"sign-flip by document ({FLIPS:,} draws)"
    elif np.all(counts == 1) and _binary(a_) and _binary(b_):
        name = "McNemar mid-p"
    else:
        name = "sign-flip by document"
    return Verdict(p, name, min_p)


def paired(
    a: Sequence[float],
    b: Sequence[float],
    documents: Sequence[Any] | None = None,
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Paired:
    """``a`` against ``b``, two equally long lists of per-question scores in the same order; ``documents``
    names each question's document (None: each question is a document of its own)."""
    a_, b_ = _pair(a, b)
    totals, counts = _totals(a_ - b_, documents)
    difference, low, high = _bootstrap([(totals, counts)], resamples, seed)
    return Paired(a_.size, totals.size, difference, low, high, primary_test(a_, b_, documents, seed=seed))


def paired_mean(
    pairs: Sequence[tuple[Sequence[float], Sequence[float]] | tuple[Sequence[float], Sequence[float], Sequence[Any]]],
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Paired:
    """The mean over tasks of mean(a) − mean(b), one (a, b[, documents]) per task. The interval resamples
    documents within each task, so each task keeps its weight; the test flips each document's share of that
    mean (a sign-flip test stratified by task)."""
    if not pairs:
        raise ValueError("a mean over tasks needs at least one task")
    strata, shares = [], []
    for a, b, *documents in pairs:
        a_, b_ = _pair(a, b)
        totals, counts = _totals(a_ - b_, documents[0] if documents else None)
        strata.append((totals, counts))
        shares.append(totals / counts.sum() / len(pairs))
    difference, low, high = _bootstrap(strata, resamples, seed)
    p, exact, min_p = _sign_flip(np.concatenate(shares), seed)
    name = "sign-flip by document within tasks" + ("" if exact else f" ({FLIPS:,} draws)")
    n = int(sum(counts.sum() for _, counts in strata))
    return Paired(n, sum(totals.size for totals, _ in strata), difference, low, high, Verdict(p, name, min_p))


def estimate(
    values: Sequence[float], documents: Sequence[Any] | None = None, *, resamples: int = RESAMPLES, seed: int = SEED
) -> Estimate:
    """The mean of per-question ``values`` with its document-bootstrap interval."""
    return mean_over_tasks([(values, documents)], resamples=resamples, seed=seed)


def mean_over_tasks(
    tasks: Sequence[tuple[Sequence[float], Sequence[Any] | None]], *, resamples: int = RESAMPLES, seed: int = SEED
) -> Estimate:
    """The unweighted mean of the tasks' mean scores, one (values, documents) per task, with an interval that
    resamples documents within each task."""
    if not tasks or any(not len(values) for values, _ in tasks):
        raise ValueError("a mean over tasks needs at least one task, each with at least one score")
    strata = [_totals(np.asarray(values, dtype=float), documents) for values, documents in tasks]
    value, low, high = _bootstrap(strata, resamples, seed)
    n = int(sum(counts.sum() for _, counts in strata))
    return Estimate(n, sum(totals.size for totals, _ in strata), value, low, high)


def primary_metric(record: dict[str, Any], default: str = "acc") -> str:
    """The metric a record is read on: the one it names, else a long-context metric it holds, else
    ``default``."""
    if record.get("metric"):
        return record["metric"]
    if "length" in record:
        return next((m for m in LONG_CONTEXT_METRICS if m in record["metrics"]), LONG_CONTEXT_METRICS[0])
    return default


def question_scores(record: dict[str, Any], results_dir: str | Path, metric: str) -> dict[Any, tuple[Any, float]]:
    """The record's per-question ``metric`` by question id, each with its document (the question's id when its
    row names none), from its outputs file or its board's pack, without the questions the score does not apply to
    (None: the reasoning runner's agreement where the full cache wrote no real solution); an empty dict when the
    record has no outputs (a record written before they were kept) or its rows do not carry ``metric``."""
    name = record.get("outputs")
    rows = packs.outputs(Path(results_dir) / name) if name else None
    scores = {}
    for row in rows or []:
        if metric not in row.get("scores", {}):
            return {}
        if row["scores"][metric] is not None:  # None: the score does not apply to this question
            scores[row["id"]] = (row.get("document", row["id"]), float(row["scores"][metric]))
    return scores


def document_scores(record: dict[str, Any], results_dir: str | Path, metric: str) -> dict[Any, float] | None:
    """The record's per-question ``metric`` by question id (see :func:`question_scores`); None when there are
    none."""
    scores = question_scores(record, results_dir, metric)
    return {i: value for i, (_, value) in scores.items()} or None


def align(
    a: dict[Any, tuple[Any, float]], b: dict[Any, tuple[Any, float]]
) -> tuple[list[float], list[float], list[Any]] | None:
    """Two runs' :func:`question_scores` in one question order, with each question's document; None when they
    were not scored on the same questions of the same documents."""
    if a.keys() != b.keys() or any(a[i][0] != b[i][0] for i in a):
        return None
    ids = sorted(a, key=str)
    return [a[i][1] for i in ids], [b[i][1] for i in ids], [a[i][0] for i in ids]


def simulated_pairs(
    rng: np.random.Generator, n: int, discordant: float, difference: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` paired 0/1 outcomes: a pair is discordant with probability ``discordant``, and right only under
    ``a`` with probability (discordant + difference) / 2, so mean(a) − mean(b) is ``difference`` in
    expectation; concordant pairs are both right or both wrong with equal probability."""
    u = rng.random(n)
    only_a, only_b = (discordant + difference) / 2, (discordant - difference) / 2
    both_right = u >= only_a + only_b + (1 - discordant) / 2
    a = (u < only_a) | both_right
    b = ((u >= only_a) & (u < only_a + only_b)) | both_right
    return a.astype(float), b.astype(float)


def simulated_documents(
    rng: np.random.Generator, documents: int, questions: int, discordant: float, agreement: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Paired 0/1 outcomes of ``questions`` questions on each of ``documents`` documents, with no true
    difference but correlated within a document: each document favours ``a`` or ``b`` at random, and each of
    its discordant questions (probability ``discordant``) goes its way with probability ``agreement``. Returns
    a, b and each question's document."""
    favours_a = np.repeat(rng.random(documents) < 0.5, questions)
    n = documents * questions
    disagree = rng.random(n) < discordant
    a_wins = np.where(rng.random(n) < agreement, favours_a, ~favours_a)
    both = rng.random(n) < 0.5
    a = np.where(disagree, a_wins, both).astype(float)
    b = np.where(disagree, ~a_wins, both).astype(float)
    return a, b, np.repeat(np.arange(documents), questions)


def simulated_scores(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` paired continuous scores in [0, 1] shaped like ROUGE-2, with no true difference: a document's level
    drawn from Beta(0.6, 4); 40 % of the pairs identical (the same output), the others each with noise of
    standard deviation 0.05."""
    level = rng.beta(0.6, 4, n)
    a = np.clip(level + rng.normal(0, 0.05, n), 0, 1)
    b = np.where(rng.random(n) < 0.4, a, np.clip(level + rng.normal(0, 0.05, n), 0, 1))
    return a, b


def rejection_rate(
    rejects: Callable[..., bool], sample: Callable[[np.random.Generator], tuple], draws: int, seed: int = SEED
) -> float:
    """The share of ``draws`` samples drawn by ``sample`` (seeded) on which ``rejects`` rejects: the
    false-positive rate when the samples hold no true difference, the power otherwise."""
    rng = np.random.default_rng(seed)
    return sum(bool(rejects(*sample(rng))) for _ in range(draws)) / draws


def _primary_rejects(a: np.ndarray, b: np.ndarray, documents: Sequence[Any] | None = None) -> bool:
    return primary_test(a, b, documents).significant


def _exact_mcnemar_rejects(a: np.ndarray, b: np.ndarray) -> bool:
    from scipy.stats import binomtest

    only_a, only_b = int(np.sum(a > b)), int(np.sum(a < b))
    return only_a + only_b > 0 and binomtest(only_a, only_a + only_b, 0.5).pvalue < ALPHA


def _bootstrap_rejects(a: np.ndarray, b: np.ndarray, documents: Sequence[Any] | None = None) -> bool:
    result = paired(a, b, documents, resamples=1_000)
    return not result.low <= 0.0 <= result.high


def calibration(draws: int, seed: int = SEED) -> str:
    """The simulation behind the choice of the primary test, as Markdown: rejection rates at 5 % with no true
    difference and with a true 10-point difference (0/1 outcomes, one question per document); on continuous
    scores; and on documents of 4 correlated questions, the per-question tests against the document-level ones.
    Bootstraps here draw 1,000 resamples."""
    tests = {"primary (McNemar mid-p)": _primary_rejects, "exact McNemar": _exact_mcnemar_rejects}
    tests["percentile bootstrap"] = _bootstrap_rejects
    lines = [
        f"Paired 0/1 outcomes, one question per document, {draws:,} draws per cell (seed {seed}): the share of "
        "draws each test rejects at 5 % with no true difference (false positives) and with a true 10-point "
        "difference (power).",
        "",
        "| n | discordant | " + " | ".join(f"{name}: false positives / power" for name in tests) + " |",
        "|---:|---:|" + "---:|" * len(tests),
    ]
    for n in (20, 50, 100):
        for q in (0.15, 0.30):
            cells = [
                " / ".join(
                    f"{rejection_rate(rejects, lambda rng: simulated_pairs(rng, n, q, d), draws, seed):.3f}"  # noqa: B023
                    for d in (0.0, 0.1)
                )
                for rejects in tests.values()
            ]
            lines.append(f"| {n} | {q:.0%} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Continuous scores shaped like ROUGE-2 (:func:`simulated_scores`), no true difference, {draws:,} "
        "draws: false positives.",
        "",
        f"| n | primary (sign-flip, exact or {FLIPS:,} draws) | percentile bootstrap |",
        "|---:|---:|---:|",
    ]
    for n in (10, 20, 50):
        rates = [
            rejection_rate(rejects, lambda rng: simulated_scores(rng, n), draws, seed)  # noqa: B023
            for rejects in (_primary_rejects, _bootstrap_rejects)
        ]
        lines.append(f"| {n} | {rates[0]:.3f} | {rates[1]:.3f} |")
    lines += [
        "",
        "Clustered: 4 questions per document, 25 % of them discordant, 90 % of a document's discordant questions "
        f"favouring the same side, no true difference ({draws:,} draws): false positives.",
        "",
        "| documents | McNemar per question | primary: sign-flip by document | bootstrap by question "
        "| bootstrap by document |",
        "|---:|---:|---:|---:|---:|",
    ]
    for documents in (10, 25, 50):
        rates = [
            rejection_rate(
                lambda a, b, groups: rejects(a, b, groups if by_document else None),  # noqa: B023
                lambda rng: simulated_documents(rng, documents, 4, 0.25, 0.9),  # noqa: B023
                draws,
                seed,
            )
            for rejects in (_primary_rejects, _bootstrap_rejects)
            for by_document in (False, True)
        ]
        lines.append(f"| {documents} | " + " | ".join(f"{rate:.3f}" for rate in rates) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4000, help="simulated samples per cell (default 4000)")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    print(calibration(args.draws, args.seed))


if __name__ == "__main__":
    main()
