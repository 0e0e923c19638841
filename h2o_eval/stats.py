"""Paired comparisons of runs scored on the same documents.

Every policy is scored on the documents the full cache was scored on, so a difference between two runs is read
from their per-document scores, pair by pair: the mean difference with a paired bootstrap interval (percentile,
seeded, 10,000 resamples, :func:`scipy.stats.bootstrap`) and, for 0/1 outcomes such as ``acc``, the exact
McNemar p-value (a two-sided binomial test on the discordant pairs, :func:`scipy.stats.binomtest`). A mean over
tasks gets its interval by resampling documents within each task.

Per-document scores live in a record's outputs file (``<record>.outputs.jsonl``): one row per document with
its ``id`` and ``scores`` (metric name to value).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESAMPLES = 10_000
SEED = 0
LEVEL = 0.95


@dataclass(frozen=True)
class Paired:
    """``a`` against ``b`` on the same ``n`` documents: ``difference`` = mean(a) − mean(b), its interval
    [``low``, ``high``], and the exact McNemar p-value when both are 0/1 outcomes (else None)."""

    n: int
    difference: float
    low: float
    high: float
    p_mcnemar: float | None

    @property
    def significant(self) -> bool:
        """The interval excludes zero."""
        return not self.low <= 0.0 <= self.high


def _interval(samples: list[np.ndarray], resamples: int, seed: int) -> tuple[float, float, float]:
    """Mean of the samples' means, and its percentile bootstrap interval resampling within each sample."""

    def statistic(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.mean([sample.mean(axis=axis) for sample in samples], axis=0)

    point = float(statistic(*samples))
    if all(np.all(sample == sample[0]) for sample in samples):  # nothing varies: every resample is the point
        return point, point, point
    from scipy.stats import bootstrap

    result = bootstrap(
        tuple(samples),
        statistic,
        n_resamples=resamples,
        confidence_level=LEVEL,
        method="percentile",
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return point, float(result.confidence_interval.low), float(result.confidence_interval.high)


def mcnemar(a: np.ndarray, b: np.ndarray) -> float:
    """Exact McNemar p-value of paired 0/1 outcomes: two-sided binomial test of the pairs where only ``a`` is
    right against those where only ``b`` is, at one half. No discordant pair gives 1."""
    from scipy.stats import binomtest

    only_a = int(np.sum((a == 1) & (b == 0)))
    only_b = int(np.sum((a == 0) & (b == 1)))
    if only_a + only_b == 0:
        return 1.0
    return float(binomtest(only_a, only_a + only_b, 0.5).pvalue)


def _binary(values: np.ndarray) -> bool:
    return bool(np.all((values == 0) | (values == 1)))


def _pair(a: list[float], b: list[float]) -> tuple[np.ndarray, np.ndarray]:
    a_, b_ = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a_.shape != b_.shape or a_.ndim != 1 or not a_.size:
        raise ValueError(f"paired scores need two equally long, non-empty lists (got {a_.shape} and {b_.shape})")
    return a_, b_


def paired(a: list[float], b: list[float], *, resamples: int = RESAMPLES, seed: int = SEED) -> Paired:
    """``a`` against ``b``, two equally long lists of per-document scores in the same document order."""
    a_, b_ = _pair(a, b)
    difference, low, high = _interval([a_ - b_], resamples, seed)
    p = mcnemar(a_, b_) if _binary(a_) and _binary(b_) else None
    return Paired(a_.size, difference, low, high, p)


def paired_mean(
    pairs: list[tuple[list[float], list[float]]], *, resamples: int = RESAMPLES, seed: int = SEED
) -> Paired:
    """The mean over tasks of mean(a) − mean(b), one (a, b) pair of score lists per task; the interval resamples
    documents within each task, so each task keeps its weight. No McNemar p-value (it is not one 2×2 table)."""
    if not pairs:
        raise ValueError("a mean over tasks needs at least one task")
    differences = [np.subtract(*_pair(a, b)) for a, b in pairs]
    difference, low, high = _interval(differences, resamples, seed)
    return Paired(sum(d.size for d in differences), difference, low, high, None)


def document_scores(record: dict[str, Any], results_dir: str | Path, metric: str) -> dict[Any, float] | None:
    """The record's per-document ``metric`` by document id, from its outputs file; None when the record has no
    outputs file (a record written before they were kept) or its rows do not carry ``metric``."""
    name = record.get("outputs")
    path = Path(results_dir) / name if name else None
    if path is None or not path.is_file():
        return None
    scores = {}
    with path.open() as handle:
        for line in handle:
            row = json.loads(line)
            if metric not in row.get("scores", {}):
                return None
            scores[row["id"]] = float(row["scores"][metric])
    return scores


def align(a: dict[Any, float], b: dict[Any, float]) -> tuple[list[float], list[float]] | None:
    """The two runs' scores in one document order, or None when they were not scored on the same documents."""
    if a.keys() != b.keys():
        return None
    ids = sorted(a, key=str)
    return [a[i] for i in ids], [b[i] for i in ids]
