"""Paired verdicts: each run compared question by question with the full cache (or another policy) on the same
documents, with the primary test's p-value, which alone decides, and the difference's document-bootstrap interval
(:mod:`h2o_eval.stats`); a setting run on several tasks also gets its mean over them. Written as
``paired_<against>.md``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from h2o_eval import stats
from h2o_eval.reports.tables import mean_kept, mixed_limits, percent, policies_per_task, setting_key


def _baseline(rows: list[dict[str, Any]], row: dict[str, Any], against: str) -> dict[str, Any] | None:
    """The row ``row`` is compared with: ``against`` on the same task, model, documents, shots and metric; at the
    same budget and protocol, except the full cache, whose protocol does not change what it holds (the same
    protocol is preferred when there are several)."""
    same = ("task", "model", "limit", "num_fewshot", "metric") + (() if against == "full" else ("protocol", "budget"))
    found = [r for r in rows if r["method"] == against and all(r[key] == row[key] for key in same)]
    return min(found, key=lambda r: (r["protocol"] != row["protocol"], r["context"] != row["context"]), default=None)


def paired_rows(rows: list[dict[str, Any]], results_dir: Path, against: str = "full") -> list[dict[str, Any]]:
    """Each row (but ``against``'s own) compared question by question with its baseline (see :func:`_baseline`): the
    row plus ``against``, ``baseline`` (its value), ``paired`` (a :class:`~h2o_eval.stats.Paired`) and ``pairs``
    (the aligned per-question scores and each question's document). Rows without per-question scores, without a
    baseline, scored on other questions than it, or of a cell that evicted nothing are left out. A setting run
    on several tasks also gets a row whose task is ``mean of N tasks``: the mean of the per-task differences,
    resampled within each task (none when a task was scored on several ``limit`` values: which documents stand
    for it is not the table's to choose); its tasks may differ in their questions per context
    (:func:`policies_per_task`)."""
    documents: dict[str | None, dict] = {}

    def scores(row: dict[str, Any]) -> dict:
        if row["outputs"] not in documents:
            documents[row["outputs"]] = stats.question_scores(row, results_dir, row["metric"])
        return documents[row["outputs"]]

    compared = []
    for row in rows:
        if row["no_eviction"]:  # not a score (tables.no_eviction)
            continue
        base = _baseline(rows, row, against) if row["method"] != against else None
        if base is None or not scores(row) or not scores(base):
            continue
        pairs = stats.align(scores(row), scores(base))
        if pairs is not None:
            compared.append(
                {**row, "against": against, "baseline": base["value"], "paired": stats.paired(*pairs), "pairs": pairs}
            )
    settings: dict[tuple, list[dict[str, Any]]] = {}
    for row, policy in zip(compared, policies_per_task(compared), strict=True):
        settings.setdefault((row["model"], row["protocol"], policy, row["budget"], row["metric"]), []).append(row)
    for (model, protocol, policy, budget, metric), group in settings.items():
        repeated = mixed_limits(group)
        if repeated:
            print(
                f"note: no mean over tasks for {model} {policy} {protocol} at {percent(budget)}: "
                f"{', '.join(repeated)} scored on several limits (give each limit's records a results dir of its own)",
                file=sys.stderr,
            )
        elif len(group) > 1:
            paired = stats.paired_mean([row["pairs"] for row in group])
            compared.append(
                {
                    "task": f"mean of {len(group)} tasks",
                    "model": model,
                    "protocol": protocol,
                    "policy": policy,
                    "budget": budget,
                    "kept": mean_kept({row["task"]: row.get("kept") for row in group}),
                    "metric": metric,
                    "value": sum(row["value"] for row in group) / len(group),
                    "limit": None,
                    "against": against,
                    "baseline": sum(row["baseline"] for row in group) / len(group),
                    "paired": paired,
                }
            )
    return compared


def paired_markdown(compared: list[dict[str, Any]]) -> str:
    """The paired comparisons as a Markdown table. The verdict is the primary test's: ``*`` marks p < 0.05; the
    interval is secondary. Cells where too few documents differ for any p below 0.05 say so, and the header says
    where several questions per document make the per-question McNemar test invalid."""
    against = compared[0]["against"] if compared else "full"
    clustered = any(r["paired"].clustered for r in compared)
    lines = [
        f"Paired against {against} on the same questions. **Primary test (the verdict): p**, a two-sided sign-flip "
        "permutation test of the mean difference that flips each document's questions together (mid-p; for 0/1 "
        "scores with one question per document it is McNemar's mid-p test; the test column names it); "
        f"* p < {stats.ALPHA}. Its false-positive rate with no true difference is at most 5 % at n = 20-100 "
        "(simulated: `python -m h2o_eval.stats`). Secondary: the difference (policy − "
        f"{against}) with its 95 % interval from a bootstrap that resamples documents ({stats.RESAMPLES:,} "
        f"resamples, seed {stats.SEED}); it is too narrow with few documents (6-13 % false positives at 10-20 in "
        "that simulation).",
        *(
            [
                "",
                "Some cells hold several questions per document: McNemar's test is per question and assumes "
                "independent questions, so it is omitted there; their p is the document-level test.",
            ]
            if clustered
            else []
        ),
        "",
        f"| task | model | protocol | policy | budget | metric | n | documents | value | {against} "
        "| difference [95 % CI] | p | test |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in compared:
        p = r["paired"]
        verdict = " *" if p.significant else "" if p.test.decidable else " (too few documents differ for p < 0.05)"
        lines.append(
            f"| {r['task']} | {r['model']} | {r['protocol']} | {r['policy']} | {percent(r['budget'])} | {r['metric']} "
            f"| {p.n} | {p.documents} | {r['value']:.3f} | {r['baseline']:.3f} "
            f"| {p.difference:+.3f} [{p.low:+.3f}, {p.high:+.3f}] | {p.test.p:.3g}{verdict} | {p.test.name} |"
        )
    return "\n".join(lines) + "\n"


def significant_settings(compared: list[dict[str, Any]]) -> frozenset[tuple]:
    """The settings (:func:`~h2o_eval.reports.tables.setting_key`) of the ``compared`` rows of :func:`paired_rows`
    that differ from the full cache beyond chance: the points the figures ring (a mean over tasks is no point)."""
    return frozenset(
        setting_key(r) for r in compared if r["against"] == "full" and r["paired"].significant and "pairs" in r
    )


def write_paired(compared: list[dict[str, Any]], out: Path) -> list[Path]:
    """:func:`paired_markdown` of ``compared`` as ``out``/paired_<against>.md (nothing when none were compared);
    returns the files."""
    if not compared:
        return []
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"paired_{compared[0]['against']}.md"
    path.write_text(paired_markdown(compared))
    return [path]
