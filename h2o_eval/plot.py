"""Accuracy (or ROUGE) against KV budget, from a results directory.

    python -m h2o_eval.plot [results_dir] [--task copa ...] [--model smollm2-135m ...] [--out DIR] [--at 0.2 ...]
    python -m h2o_eval.plot [results_dir] --leaderboard

One figure per task (PNG and PDF): a line per (model, policy, protocol) with lm-eval's stderr as error bars, the
full cache of each model as a dashed reference and the oracle (policy ``oracle``) as a dotted one, the budget in
percent of what it is a share of (the sequence, the prompt or the context, by protocol); points of different
lines at one budget are drawn slightly apart. Also writes the same numbers as ``summary.csv`` and ``summary.md``
(ending with what the runs cost, summed and elapsed); ``--wandb-group`` logs them to a sweep's W&B group.

Every run is compared, question by question, with the full cache (or with ``--against POLICY`` at the same
budget and protocol) on the same documents: ``paired_<against>.md`` holds the difference with its
document-bootstrap 95 % interval and the primary test's p-value, which alone decides ``*`` (see
:mod:`h2o_eval.stats`), and a mean over the tasks a setting was run on; figures ring the significant points.

Long-context records (RULER's tasks) also get their headline, ``headline.md``: per setting, each task's score
x100 with its document-bootstrap interval and the unweighted mean over tasks ("k/13 tasks" when fewer than
RULER's thirteen ran), whose interval resamples documents within each task. ``--leaderboard`` writes, per model,
protocol and length, that mean as a table policy x compression ratio (1 − budget, kvpress's convention; the full
cache's ceiling row first, then the oracle's) in Markdown and CSV, and the figure score against compression
ratio. ``--needle`` draws the long-context tasks' depth x length heatmaps instead (:mod:`h2o_eval.plot_needle`).

``--provenance`` writes ``PROVENANCE.md`` instead: where the records came from, read from the records themselves
(per commit: how many, whether its tree was dirty, when, the machine time, threads and library versions, what
ran) and the settings they share or vary in, so that no README has to carry that by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from h2o_eval import plot_needle
from h2o_eval.reports.figures import write_figures
from h2o_eval.reports.headline import headline_markdown, long_context, task_order, write_headline
from h2o_eval.reports.leaderboards import write_leaderboards
from h2o_eval.reports.paired import paired_markdown, paired_rows, significant_settings, write_paired
from h2o_eval.reports.tables import (
    COLUMNS,
    compute,
    limit_label,
    markdown,
    mixed_limits,
    side_by_side,
    table,
    write_tables,
)
from h2o_eval.results import read_records
from h2o_eval.settings import report_labels

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "accuracy_vs_budget.ipynb"


def write(
    rows: list[dict[str, Any]],
    out: Path,
    at: list[float] | None = None,
    compared: list[dict[str, Any]] | None = None,
    headline: list[dict[str, Any]] | None = None,
) -> list[Path]:
    """Figures (PNG, PDF) per task plus the tables of :func:`~h2o_eval.reports.tables.write_tables` under ``out``,
    the ``compared`` rows of :func:`~h2o_eval.reports.paired.paired_rows` in ``paired_<against>.md`` (ringing,
    when they are against the full cache, the significant points of the figures), and the long-context settings of
    :func:`~h2o_eval.reports.headline.long_context` in ``headline.md``; returns the files."""
    compared = compared or []
    written = write_figures(rows, out, significant_settings(compared))
    written += write_tables(rows, out, at)
    written += write_paired(compared, out)
    return written + write_headline(headline or [], out)


PROVENANCE = "PROVENANCE.md"
PROVENANCE_VERSIONS = ("torch", "transformers", "lm_eval")
# The settings every report names in its own columns, in the order the provenance lists them.
PROVENANCE_NAMED = ("model", "task", "length", "policy", "budget", "protocol", "num_fewshot", "limit", "data")
# How a run was run: never part of its identity (results.NOT_IDENTITY), so never a reason its numbers differ.
PROVENANCE_HOW = ("batch_size", "stack_cells", "device", "kernels")


def _utc(created: str) -> datetime:
    return datetime.fromisoformat(created).astimezone(timezone.utc)


def _duration(seconds: float) -> str:
    return f"{seconds:,.0f} s" + (f" ({seconds / 3600:.1f} h)" if seconds >= 3600 else "")


def _counted(values: list[Any]) -> str:
    """The distinct ``values``, most common first, each with its count when there are several ("1" or
    "4 (30), 1 (9)")."""
    counts = Counter("–" if value is None else str(value) for value in values)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{value} ({n})" for value, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _span(records: list[dict[str, Any]]) -> float:
    """Seconds from the first record's start (``created`` minus ``wall_seconds``) to the last one's end."""
    starts = [_utc(r["created"]) - timedelta(seconds=r.get("wall_seconds") or 0.0) for r in records]
    return (max(_utc(r["created"]) for r in records) - min(starts)).total_seconds()


def _commit_row(commit: str, records: list[dict[str, Any]]) -> str:
    created = sorted(_utc(r["created"]) for r in records)
    dirty = sum((r.get("git") or {}).get("dirty") is True for r in records)
    unknown = sum((r.get("git") or {}).get("dirty") is None for r in records)
    versions = [_counted([(r.get("versions") or {}).get(name) for r in records]) for name in PROVENANCE_VERSIONS]
    cells = [
        commit,
        str(len(records)),
        str(dirty) + (f" ({unknown} unknown)" if unknown else ""),
        f"{created[0]:%Y-%m-%d %H:%M}",
        f"{created[-1]:%Y-%m-%d %H:%M}",
        _duration(sum(r.get("wall_seconds") or 0.0 for r in records)),
        _duration(sum(r.get("load_seconds") or 0.0 for r in records)),
        _duration(_span(records)),
        _counted([(r.get("threads") or {}).get("torch") for r in records]),
        *versions,
        ", ".join(sorted({r["model"] for r in records})),
    ]
    return "| " + " | ".join(cells) + " |"


def provenance(records: list[dict[str, Any]], source: str, chosen: str = "") -> str:
    """Where ``records`` (read from ``source``, those of the ``--task``/``--model`` options in ``chosen``) came
    from, as Markdown: per commit (the oldest first) how many
    records it computed, how many of them with a dirty tree, the first and last ``created``, the summed
    ``wall_seconds`` and ``load_seconds`` and the elapsed span, the torch threads, the versions of torch,
    transformers and lm_eval and the models; then what each commit computed; then the settings every record
    shares and those that vary, with their counts. Everything is read from the records, so regenerating it from
    the same records writes the same file."""
    if not records:
        raise ValueError(f"no records in {source}: nothing to tell the provenance of")
    by_commit: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        commit = (record.get("git") or {}).get("commit")
        by_commit.setdefault(commit[:7] if commit else "unknown", []).append(record)
    commits = sorted(by_commit, key=lambda c: (min(_utc(r["created"]) for r in by_commit[c]), c))
    dirty = sum((r.get("git") or {}).get("dirty") is True for r in records)
    first, last = min(_utc(r["created"]) for r in records), max(_utc(r["created"]) for r in records)
    lines = [
        f"# Provenance of `{source}`",
        "",
        f"Generated from the records by `python -m h2o_eval.plot {source}{chosen} --provenance`: every entry is "
        "read from "
        "the records (`git`, `created`, `wall_seconds`, `load_seconds`, `threads`, `versions`, `config`). "
        "Regenerate it; never edit it.",
        "",
        f"{len(records)} records, computed at {len(commits)} commit{'s' if len(commits) != 1 else ''} ({dirty} of "
        f"them with a dirty tree: uncommitted changes), from {first:%Y-%m-%d %H:%M} to {last:%Y-%m-%d %H:%M} UTC.",
        "",
        "## Commits",
        "",
        "Times are UTC. Run time is the records' summed `wall_seconds` (a grid's cells share their run time); "
        "load is the summed `load_seconds` (a grid's cells share one model load, counted once per cell); elapsed "
        "runs from the first record's start to the last one's end, overlapping runs counted once. Threads: "
        "torch's intra-op threads per process.",
        "",
        "| commit | records | dirty | first created | last created | run time | load | elapsed | threads "
        "| " + " | ".join(PROVENANCE_VERSIONS) + " | models |",
        "|---|---:|---:|---|---|---:|---:|---:|---|---|---|---|---|",
        *(_commit_row(commit, by_commit[commit]) for commit in commits),
        _commit_row("**all**", records),
        "",
        "## What each commit computed",
        "",
        "| commit | model | records | tasks | policies | budgets |",
        "|---|---|---:|---|---|---|",
    ]
    for commit in commits:
        for model in sorted({r["model"] for r in by_commit[commit]}):
            mine = [r for r in by_commit[commit] if r["model"] == model]
            tasks = sorted({r["task"] for r in mine}, key=task_order)
            policies = sorted({r["policy"] for r in mine})
            budgets = sorted({r["budget"] for r in mine}, key=lambda b: (isinstance(b, int), b))
            lines.append(
                f"| {commit} | {model} | {len(mine)} | {', '.join(tasks)} | {', '.join(policies)} "
                f"| {', '.join(f'{b:g}' for b in budgets)} |"
            )
    lines += ["", "## Settings", "", *_settings_lines(records)]
    return "\n".join(lines) + "\n"


def _settings_lines(records: list[dict[str, Any]]) -> list[str]:
    """The settings every record shares and those that vary (each value with its record count): those the
    reports name in columns, the departures from the defaults (:func:`h2o_eval.settings.report_labels`), then
    how the runs were run, which never changes a number (batch size, stacked cells, device, kernels)."""
    shared: list[str] = []
    varying: list[str] = []

    def sort(name: str, values: list[Any], note: str = "") -> None:
        (shared if len(set(map(str, values))) == 1 and not note else varying).append(
            f"{name}: {_counted(values)}{note}"
        )

    for key in PROVENANCE_NAMED:
        sort(key, [_short(r.get(key)) if key == "data" else r.get(key) for r in records])
    labelled = [r for r in records if "config" in r and "policy_params" in r]
    if labelled:
        own, common = report_labels([r["config"] for r in labelled], [r["policy_params"] for r in labelled])
        shared += common
        for key in dict.fromkeys(key for departures in own for key in departures):
            texts = [departures[key] for departures in own if key in departures]
            rest = len(labelled) - len(texts)
            sort(key, texts, f"; the other {rest}: its default, or not a setting of theirs" if rest else "")
        for key in PROVENANCE_HOW:
            if any(key in r["config"] for r in labelled):
                sort(f"{key} (not identity)", [r["config"].get(key) for r in labelled])
    if len(labelled) < len(records):
        varying.append(f"{len(records) - len(labelled)} records hold no config: their other settings are unknown")
    return [
        "Every record:" if shared else "No setting is shared by every record.",
        "",
        *(f"- {text}" for text in shared),
        *(
            ["", "Varying, with the number of records of each value:", "", *(f"- {text}" for text in varying)]
            if varying
            else []
        ),
    ]


def _short(data: Any) -> Any:
    """A data fingerprint as its first 12 hex digits (``hub`` as it is)."""
    return data[:12] if isinstance(data, str) and len(data) > 16 else data


def write_provenance(records: list[dict[str, Any]], source: str, out: Path, chosen: str = "") -> Path:
    """:func:`provenance` of ``records`` as ``out``/PROVENANCE.md; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / PROVENANCE
    path.write_text(provenance(records, source, chosen))
    return path


def log_to_wandb(rows: list[dict[str, Any]], files: list[Path], group: str, project: str, mode: str) -> None:
    """Log the figures and the table as one W&B run in ``group`` (a sweep's runs share its folder's name)."""
    import wandb

    run = wandb.init(project=project, group=group, job_type="plot", mode=mode, name=f"{group}-plots")
    run.log(
        {
            **{f"figures/{path.stem}": wandb.Image(str(path)) for path in files if path.suffix == ".png"},
            "summary": wandb.Table(columns=list(COLUMNS), data=[[row[c] for c in COLUMNS] for row in rows]),
        }
    )
    run.finish()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default="results", type=Path)
    parser.add_argument("--task", nargs="*", help="only these tasks")
    parser.add_argument("--model", nargs="*", help="only these models")
    parser.add_argument("--metric", help="metric to plot (default: the record's, else acc)")
    parser.add_argument("--out", type=Path, help="output folder (default: <results_dir>/plots)")
    parser.add_argument("--at", type=float, nargs="*", help="also tables of the policies side by side at these budgets")
    parser.add_argument("--wandb-group", help="also log the figures and table to W&B, in this group")
    parser.add_argument("--wandb-project", default="h2o_eval")
    parser.add_argument("--wandb-mode", default="offline", choices=["offline", "online"])
    parser.add_argument(
        "--against", default="full", help="paired comparisons with this policy at the same budget (default: full)"
    )
    parser.add_argument("--needle", action="store_true", help="long-context tasks: depth x length heatmaps instead")
    parser.add_argument(
        "--provenance",
        action="store_true",
        help="write PROVENANCE.md instead: per commit the records computed at it, their times, threads, versions "
        "and settings",
    )
    parser.add_argument(
        "--leaderboard",
        action="store_true",
        help="long-context tasks: the mean over tasks per policy and compression ratio instead (table and figure)",
    )
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    out = args.out or args.results_dir / "plots"
    try:
        _plot(args, out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def _plot(args: argparse.Namespace, out: Path) -> None:
    """What ``main`` does once its arguments are parsed; ValueError is a one-line refusal."""
    if not args.results_dir.is_dir():
        raise ValueError(f"no results directory {args.results_dir}: give the results_dir the runs wrote to")
    records, unreadable = read_records(args.results_dir)
    if not records:
        if not unreadable:
            raise ValueError(f"no records in {args.results_dir}: give the results_dir the runs wrote to")
        raise ValueError(
            f"no record in {args.results_dir} was readable: skipped {'; '.join(map(str, unreadable))}"
            + (f" (the figures in {out} are an earlier plot's)" if out.is_dir() else "")
        )
    for error in unreadable:
        print(f"warning: skipped {error}", file=sys.stderr)
    chosen = [
        r
        for r in records
        if (not args.task or r["task"] in args.task or f"{r['task']}@{r.get('length')}" in args.task)
        and (not args.model or r["model"] in args.model)
    ]
    if not chosen:
        raise ValueError(
            f"no record in {args.results_dir} of --task {' '.join(args.task or ['any'])} and --model "
            f"{' '.join(args.model or ['any'])}: its tasks are {', '.join(sorted({r['task'] for r in records}))}, "
            f"its models {', '.join(sorted({r['model'] for r in records}))}"
        )
    if args.provenance:
        options = "".join(
            f" --{name} {' '.join(getattr(args, name))}" for name in ("task", "model") if getattr(args, name)
        )
        print(write_provenance(chosen, str(args.results_dir), out, options))
        return
    rows = table(chosen, args.metric)
    if args.needle:
        files = plot_needle.write(rows, args.results_dir, out)
        if not files:
            raise ValueError(f"no long-context records in {args.results_dir}: run a task such as task=niah_single_1")
        print("\n".join(map(str, files)))
        return
    if not rows:
        raise ValueError(
            f"no record in {args.results_dir} has {f'the metric {args.metric}' if args.metric else 'its metric'} "
            "at a fraction budget: name a metric the records hold (--metric), or run fraction budgets such as 0.2"
        )
    try:
        headline = long_context(rows, args.results_dir)
    except ValueError as error:
        if args.leaderboard:
            raise
        print(f"note: no long-context headline: {error}", file=sys.stderr)
        headline = []
    if args.leaderboard:
        if not any(s["method"] != "full" for s in headline):
            raise ValueError(
                f"no long-context records of a policy with per-question outputs in {args.results_dir}: "
                "run long-context tasks at several budgets first (such as the kv_leaderboard preset)"
            )
        files, text = write_leaderboards(headline, out)
        print("\n".join(map(str, files)))
        print(text)
        return
    for task, limits in mixed_limits(rows).items():
        print(
            f"note: {task} has records of {', '.join(map(limit_label, limits))}: they are drawn and tabled apart",
            file=sys.stderr,
        )
    compared = paired_rows(rows, args.results_dir, args.against)
    if not compared:
        print(
            f"note: no paired comparison against {args.against}: no two runs with per-question scores share questions",
            file=sys.stderr,
        )
    files = write(rows, out, args.at, compared, headline)
    for path in files:
        print(path)
    print(markdown(rows) + compute(rows))
    for budget in args.at or []:
        print(side_by_side(rows, budget))
    if compared:
        print(paired_markdown(compared))
    if headline:
        print(headline_markdown(headline))
    if args.wandb_group:
        log_to_wandb(rows, files, args.wandb_group, args.wandb_project, args.wandb_mode)


if __name__ == "__main__":
    main()
