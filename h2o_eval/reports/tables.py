"""The report's rows and its tables: one row per run (:func:`table`), labelled by what departs from the defaults,
as ``summary.md`` and ``summary.csv`` with what the runs cost, and the policies side by side at one budget
(``at_<budget>.md``). Every other report module reads these rows."""

from __future__ import annotations

import csv
from collections.abc import Collection
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from h2o_eval import results, stats
from h2o_eval.settings import flatten, questions, report_labels

PRIMARY_METRIC = {"xsum": "rouge2", "cnn_dailymail": "rouge2"}
COLUMNS = (
    "task",
    "model",
    "protocol",
    "policy",
    "budget",
    "metric",
    "value",
    "stderr",
    "n_samples",
    "num_fewshot",
    "limit",
)


def table(records: list[dict[str, Any]], metric: str | None = None) -> list[dict[str, Any]]:
    """One row per run: the task's primary metric (the record's ``metric``, else ``acc``,
    ``rouge2`` for summarisation, ``string_match_all`` or ``string_match_part`` for long context) unless ``metric``
    names another, sorted by task, model, protocol, policy and budget. A long-context task is one task per prompt
    length (``niah_single@4096``): its documents, and so its comparisons, differ with it.

    A threshold run (``dms``) is kept whatever its budget, and its row's ``kept`` is the share it realised
    (:func:`kept_share`; None for the other rows): figures and leaderboards place it there (:func:`position`). Its
    ``threshold`` is the label of its curve, the runs of one base at other thresholds (``knorm (threshold)``; None
    for the other rows).

    A row's ``policy`` is its label: the policy's name (``method``) and each departure from the defaults that not
    every row shares (``snapkv (window=8)``, ``h2o (decoding=grow)``, ``full (4 questions per context)``:
    :func:`h2o_eval.settings.report_labels`); ``shared`` names those every row shares. A row also has
    ``questions`` (per context, None outside long context) and ``policy_without_questions``, its label without
    them, for reports that name each task's questions per context once (the shared-context leaderboard asks cwe,
    fwe and qa_2 one question, the other tasks four). Of records that are one setting (one identity), the newest
    is kept; two records that would share a row with different identities (data files that changed, say) raise
    ValueError naming what differs."""
    kept = []
    for record in records:
        name = metric or stats.primary_metric(record, PRIMARY_METRIC.get(record["task"], "acc"))
        if name in record["metrics"]:
            kept.append((record, name))
    own, shared = report_labels([r["config"] for r, _ in kept], [r["policy_params"] for r, _ in kept])
    newest: dict[tuple, dict[str, Any]] = {}
    for (record, name), departures in sorted(zip(kept, own, strict=True), key=lambda item: item[0][0]["created"]):
        labelled = _threshold(record, departures)
        row = {
            "task": record["task"] + (f"@{record['length']}" if "length" in record else ""),
            "length": record.get("length"),
            "model": record["model"],
            "protocol": record["protocol"],
            "policy": record["policy"] + _departures_label(labelled.values()),
            "policy_without_questions": record["policy"]
            + _departures_label(text for key, text in labelled.items() if key != "task.questions"),
            "questions": questions(record["config"]),
            "method": record["policy"],
            "threshold": _threshold_curve(record, departures),
            "context": tuple(text for key, text in departures.items() if not key.startswith("policy.")),
            "task_settings": tuple(text for key, text in departures.items() if _task_setting(key)),
            "policy_in_task": record["policy"]
            + _departures_label(text for key, text in labelled.items() if not _task_setting(key)),
            "shared": tuple(shared),
            "budget": record["budget"],
            "kept": kept_share(record),
            "held": record.get("capacity", {}).get("capacity_mean"),
            "metric": name,
            "value": record["metrics"][name],
            "stderr": record["metrics"].get(f"{name}_stderr"),
            "n_samples": record["metrics"].get(f"{name}_n", record["n_samples"]),
            "no_eviction": no_eviction(record),
            "num_fewshot": record["num_fewshot"],
            "limit": record["limit"],
            "outputs": record.get("outputs"),
            "wall_seconds": record.get("wall_seconds"),
            "created": record["created"],
            "identity": results.record_identity(record),
        }
        key = tuple(row[c] for c in COLUMNS if c not in ("value", "stderr", "n_samples"))
        if key in newest:
            _check_one_setting(newest[key], row)
        newest[key] = row
    return sorted(newest.values(), key=lambda r: (r["task"], r["model"], r["protocol"], r["policy"], r["budget"]))


def no_eviction(record: dict[str, Any]) -> bool:
    """Whether a record that counts its evictions (``metrics.evicted``, the share of problems whose cache let a
    token go: the reasoning runner's) evicted nothing in any problem, under a policy that may evict: its scores are
    the full cache's by construction, and reports mark it "no eviction" instead of showing them."""
    return record["metrics"].get("evicted") == 0 and record["policy"] != "full"


def shown(row: dict[str, Any], digits: int = 4) -> str:
    """A row's value as the tables print it (``value ± stderr``), or "no eviction" (:func:`no_eviction`)."""
    if row.get("no_eviction"):
        return "no eviction"
    return f"{row['value']:.{digits}f}" + (f" ± {row['stderr']:.{digits}f}" if row["stderr"] is not None else "")


def kept_share(record: dict[str, Any]) -> float | None:
    """For a threshold run (``dms``), which has no budget, the share of the prompt it kept (the record's
    ``capacity.kept_fraction_mean``, to 4 decimals): where figures and leaderboards place it. None for the rest,
    placed at their budget (:func:`position`)."""
    if record.get("policy_params", {}).get("name") != "dms":
        return None
    return round(float(record["capacity"]["kept_fraction_mean"]), 4)


def position(row: dict[str, Any]) -> float:
    """Where a row (or a setting of rows) stands on a budget axis: its realised share if it is a threshold run's,
    else its budget."""
    return row["budget"] if row.get("kept") is None else row["kept"]


def mean_kept(kept: dict[str, float | None]) -> float | None:
    """A threshold setting's realised share over its tasks (the mean of each task's, to 4 decimals), where its
    leaderboard places it; None for a setting at a budget."""
    shares = [share for share in kept.values() if share is not None]
    return round(sum(shares) / len(shares), 4) if shares else None


def _threshold(record: dict[str, Any], departures: dict[str, str]) -> dict[str, str]:
    """A threshold run's label names its threshold even where it is the YAML's (its budget is no setting)."""
    params = record["policy_params"]
    if params["name"] != "dms" or "policy.threshold" in departures:
        return departures
    return {"policy.threshold": f"threshold={params['threshold']}", **departures}


def _threshold_curve(record: dict[str, Any], departures: dict[str, str]) -> str | None:
    """A threshold run's curve: its label without its threshold, which varies along the curve."""
    if record.get("policy_params", {}).get("name") != "dms":
        return None
    others = (text for key, text in departures.items() if key not in ("policy.threshold", "threshold"))
    return record["policy"] + _departures_label([*others, "threshold"])


def _task_setting(key: str) -> bool:
    """A departure that is the task's setting (``task.max_new_tokens``) rather than the policy's: the side-by-side
    table names it with the task. Questions per context stay with the policy (:func:`policies_per_task`)."""
    return key.startswith("task.") and key != "task.questions"


def _departures_label(texts: Collection[str]) -> str:
    texts = list(texts)
    return f" ({', '.join(texts)})" if texts else ""


def _check_one_setting(older: dict[str, Any], newer: dict[str, Any]) -> None:
    """Two records that would be one row: reruns of one setting (kept: the newer), or different settings that no
    label tells apart, refused in one line naming what differs."""
    before, after = flatten(older["identity"]), flatten(newer["identity"])
    differ = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    if differ:
        raise ValueError(
            f"{newer['task']} {newer['model']} {newer['policy']} {newer['protocol']} at {percent(newer['budget'])}: "
            f"two records differ in {', '.join(differ)}, which no report column shows: plot them from separate "
            "results dirs"
        )


def shared_note(rows: list[dict[str, Any]]) -> str:
    """The settings every row of a report shares beyond its columns (``decoding=grow, 4 questions per context``),
    as a clause for a title, or ""."""
    return ", ".join(rows[0]["shared"]) if rows else ""


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (value ± stderr), after the settings every row shares."""
    lines = [
        *([f"Every row, where it applies: {shared_note(rows)}.", ""] if shared_note(rows) else []),
        "| task | model | protocol | policy | budget | metric | value | n | shots | limit |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['model']} | {r['protocol']} | {r['policy']} | {percent(r['budget'])} | {r['metric']} "
            f"| {shown(r)} | {r['n_samples']} | {r['num_fewshot']} | {r['limit']} |"
        )
    return "\n".join(lines) + "\n"


def compute(rows: list[dict[str, Any]]) -> str:
    """What the rows cost: their records' summed ``wall_seconds`` and the span from the first run's start
    (``created`` minus its ``wall_seconds``) to the last run's end, the elapsed time when they ran in one go; a
    paragraph to append to a table, empty when no record holds ``wall_seconds``."""
    timed = [r for r in rows if r.get("wall_seconds") is not None]
    if not timed:
        return ""
    starts = [datetime.fromisoformat(r["created"]) - timedelta(seconds=r["wall_seconds"]) for r in timed]
    ends = [datetime.fromisoformat(r["created"]) for r in timed]
    summed = sum(r["wall_seconds"] for r in timed)
    span = (max(ends) - min(starts)).total_seconds()
    return (
        f"\nCompute: {len(timed)} records, {summed:,.0f} s of run time summed (`wall_seconds`); they ran from "
        f"{min(starts):%Y-%m-%d %H:%M} to {max(ends):%Y-%m-%d %H:%M} UTC, {span:,.0f} s elapsed.\n"
    )


def mixed_limits(rows: list[dict[str, Any]]) -> dict[str, list[int | float | None]]:
    """Tasks whose rows were scored on different ``limit``s (document counts), with those limits: their
    numbers are not comparable, so figures and tables keep them apart."""
    limits: dict[str, set] = {}
    for r in rows:
        limits.setdefault(r["task"], set()).add(r["limit"])
    return {task: sorted(found, key=limit_order) for task, found in limits.items() if len(found) > 1}


def percent(budget: float | int) -> str:
    """A budget as every report prints it: a fraction as a percentage ("20%"), a count of tokens as such ("512
    tokens")."""
    if isinstance(budget, int):
        return f"{budget} tokens"
    return f"{100 * budget:.3g}%"


def limit_order(limit: int | float | None) -> tuple[bool, float]:
    """A sort key for ``limit`` values: the smallest first, all documents (None) last."""
    return limit is None, limit or 0


def limit_label(limit: int | float | None) -> str:
    """How reports name the documents a row was scored on ("limit=10", or "all documents")."""
    return f"limit={limit}" if limit is not None else "all documents"


def side_by_side(rows: list[dict[str, Any]], budget: float) -> str:
    """A Markdown table with a row per (task, model) and a column per policy (and protocol) at ``budget``,
    beside the full cache: the comparison a budget is chosen for. Values are ``value ± stderr``; a setting
    that has no record is left empty. Records of a task scored on different ``limit``s, or under different settings
    of the task (``task.max_new_tokens=1024``, named with it), get a row each."""
    at = [r for r in rows if r["budget"] == budget]
    columns = sorted({(r["policy_in_task"], r["protocol"]) for r in at if r["method"] != "full"})

    def key(r: dict[str, Any]) -> tuple:
        return r["task"], r["task_settings"], r["model"], r["limit"]

    keys = sorted({key(r) for r in rows}, key=lambda k: (*k[:3], limit_order(k[3])))
    cell = {(*key(r), r["policy_in_task"], r["protocol"]): r for r in at}
    full = {key(r): r for r in rows if r["method"] == "full"}
    mixed = mixed_limits(rows)

    def show(r: dict[str, Any] | None) -> str:
        return "" if r is None else shown(r, 3)

    header = ["task", "model", "metric", "n", "full", *(f"{p} ({protocol})" for p, protocol in columns)]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|---:|" + "---:|" * (len(columns) + 1)]
    for task, settings, model, limit in keys:
        some = next(r for r in rows if key(r) == (task, settings, model, limit))
        values = [show(full.get((task, settings, model, limit)))]
        values += [show(cell.get((task, settings, model, limit, *c))) for c in columns]
        name = f"{model} ({limit_label(limit)})" if task in mixed else model
        label = task + _departures_label(settings)
        lines.append(f"| {label} | {name} | {some['metric']} | {some['n_samples']} | " + " | ".join(values) + " |")
    return (
        f"Budget {percent(budget)}{'' if isinstance(budget, int) else ' of the cache'}:\n\n" + "\n".join(lines) + "\n"
    )


def setting_key(row: dict[str, Any]) -> tuple:
    """What tells one row's setting from another's in every report: how paired verdicts find their figure's
    points."""
    return row["task"], row["model"], row["protocol"], row["policy"], row["budget"], row["limit"]


def policies_per_task(rows: list[dict[str, Any]]) -> list[str]:
    """Each row's policy label in a report over several tasks (a headline, a mean over tasks): without its
    questions per context where every row of its task (model and length) was asked one count, which the report
    then names per task (see :func:`h2o_eval.reports.headline.questions_note`), so that a policy's tasks asked 4
    and 1 questions stay one setting; with them where the task was asked several counts, which only the label
    tells apart."""
    asked: dict[tuple, set] = {}
    for row in rows:
        asked.setdefault((row["model"], row["length"], row["task"]), set()).add(row["questions"])
    return [
        row["policy_without_questions"]
        if len(asked[(row["model"], row["length"], row["task"])]) == 1
        else row["policy"]
        for row in rows
    ]


def write_tables(rows: list[dict[str, Any]], out: Path, at: list[float] | None = None) -> list[Path]:
    """``summary.csv`` and ``summary.md`` (:func:`markdown` and :func:`compute`) of ``rows`` under ``out`` and, for
    each budget in ``at``, the policies side by side in ``at_<budget>.md``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    marked = any(r["no_eviction"] for r in rows)  # a column of its own only where some row evicted nothing
    with (out / "summary.csv").open("w", newline="") as handle:
        columns = [*COLUMNS, *(["no_eviction"] if marked else [])]
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**r, "value": None} if r["no_eviction"] else r for r in rows)
    (out / "summary.md").write_text(markdown(rows) + compute(rows))
    written = [out / "summary.csv", out / "summary.md"]
    for budget in at or []:
        written.append(out / f"at_{budget:g}.md")
        written[-1].write_text(side_by_side(rows, budget))
    return written
