"""Accuracy (or ROUGE) against KV budget, from a results directory.

    python -m h2o_eval.plot [results_dir] [--task copa ...] [--model smollm2-135m ...] [--out DIR] [--at 0.2 ...]
    python -m h2o_eval.plot [results_dir] --leaderboard
    python -m h2o_eval.plot [results_dir] --board

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

``--board`` writes the reasoning board's ``board.md`` instead (:mod:`h2o_eval.reports.board`): per task and model the
budget in tokens as rows and a column per policy. A record that evicted nothing in any problem (``metrics.evicted``
0) says "no eviction" in every table and figure instead of its scores, and is left out of the paired tests.

``--provenance`` writes ``PROVENANCE.md`` instead: where the records came from, read from the records themselves
(per commit: how many, whether its tree was dirty, when, the machine time, threads and library versions, what
ran) and the settings they share or vary in, so that no README has to carry that by hand.

Each output is made by a module of :mod:`h2o_eval.reports`; this module reads the options and the records and
says which outputs to write.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from h2o_eval import plot_needle
from h2o_eval.checks import budget_value
from h2o_eval.reports.board import write_board
from h2o_eval.reports.figures import write_figures
from h2o_eval.reports.headline import headline_markdown, long_context, write_headline
from h2o_eval.reports.leaderboards import write_leaderboards
from h2o_eval.reports.paired import paired_markdown, paired_rows, significant_settings, write_paired
from h2o_eval.reports.provenance import write_provenance
from h2o_eval.reports.tables import (
    compute,
    limit_label,
    markdown,
    mixed_limits,
    side_by_side,
    table,
    write_tables,
)
from h2o_eval.reports.turns import write_by_turn
from h2o_eval.reports.wandb_log import log_to_wandb
from h2o_eval.results import read_records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default="results", type=Path)
    parser.add_argument("--task", nargs="*", help="only these tasks")
    parser.add_argument("--model", nargs="*", help="only these models")
    parser.add_argument("--metric", help="metric to plot (default: the record's, else acc)")
    parser.add_argument("--out", type=Path, help="output folder (default: <results_dir>/plots)")
    parser.add_argument(
        "--at", type=budget_value, nargs="*", help="also tables of the policies side by side at these budgets"
    )
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
        "--board",
        action="store_true",
        help="reasoning records: board.md, per task and model the budget in tokens as rows and a column per policy, "
        "for agreement, the kept trace, accuracy, the generated length, each class's share and the evicting share",
    )
    parser.add_argument(
        "--by",
        choices=["turn"],
        help="turn: protocol=turns records, the scores at each turn of the conversation (turns.md, turns.png, and the "
        "paired comparisons at each turn)",
    )
    parser.add_argument(
        "--leaderboard",
        action="store_true",
        help="long-context tasks: the mean over tasks per policy and compression ratio instead (table and figure)",
    )
    args = parser.parse_args(argv)
    args.task, args.model = _names(args.task), _names(args.model)
    import matplotlib

    matplotlib.use("Agg")
    out = args.out or args.results_dir / "plots"
    try:
        _plot(args, out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def _plot(args: argparse.Namespace, out: Path) -> None:
    """What ``main`` does once its arguments are parsed: the provenance, the needle pictures, the leaderboards or
    the report of the chosen records; ValueError is a one-line refusal."""
    records = _chosen_records(args, out)
    if args.provenance:
        options = "".join(
            f" --{name} {' '.join(getattr(args, name))}" for name in ("task", "model") if getattr(args, name)
        )
        print(write_provenance(records, str(args.results_dir), out, options))
        return
    if args.by == "turn":
        files, text = write_by_turn(records, args.results_dir, out, args.against)
        print("\n".join(map(str, files)))
        print(text)
        return
    if args.board:
        files = write_board(records, out)
        print("\n".join(map(str, files)))
        print(files[0].read_text())
        return
    rows = table(records, args.metric)
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
    headline = _headline(rows, args)
    if args.leaderboard:
        _leaderboards(headline, args, out)
    else:
        _report(rows, headline, args, out)


def _chosen_records(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """The readable records of ``args.results_dir`` of the ``--task`` and ``--model`` options, warning of each file
    skipped; ValueError when there are none, naming why."""
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
    tasks, models = {r["task"] for r in records}, {r["model"] for r in records}
    named = [(r, {r["task"], f"{r['task']}@{r.get('length')}"}) for r in records]  # a task, or a task at a length
    known_tasks = set().union(*(names for _, names in named))
    for option, names, known in (("task", args.task, known_tasks), ("model", args.model, models)):
        if missing := [name for name in names or [] if name not in known]:
            raise ValueError(
                f"no record in {args.results_dir} of --{option} {' '.join(missing)}: its tasks are "
                f"{', '.join(sorted(tasks))}, its models {', '.join(sorted(models))}"
            )
    chosen = [
        r
        for r, names in named
        if (not args.task or names & set(args.task)) and (not args.model or r["model"] in args.model)
    ]
    if not chosen:
        raise ValueError(
            f"no record in {args.results_dir} of --task {' '.join(args.task or ['any'])} and --model "
            f"{' '.join(args.model or ['any'])} together: its tasks are {', '.join(sorted(tasks))}, its models "
            f"{', '.join(sorted(models))}"
        )
    return chosen


def _names(values: list[str] | None) -> list[str] | None:
    """An option's names given apart (``--task a b``) or as Hydra lists them (``--task a,b``)."""
    return None if values is None else [name for value in values for name in value.split(",") if name]


def _headline(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The long-context headline of ``rows``; where it cannot be made, a refusal for ``--leaderboard``, which is
    made of it, and a note (and no headline) for the report."""
    try:
        return long_context(rows, args.results_dir)
    except ValueError as error:
        if args.leaderboard:
            raise
        print(f"note: no long-context headline: {error}", file=sys.stderr)
        return []


def _leaderboards(headline: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    """``--leaderboard``: the leaderboards of the headline's settings, written and printed."""
    if not any(s["method"] != "full" for s in headline):
        raise ValueError(
            f"no long-context records of a policy with per-question outputs in {args.results_dir}: "
            "run long-context tasks at several budgets first (such as the kv_leaderboard preset)"
        )
    files, text = write_leaderboards(headline, out)
    print("\n".join(map(str, files)))
    print(text)


def _report(rows: list[dict[str, Any]], headline: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    """The report: figures, tables, paired verdicts against ``--against`` and the headline, written, printed and,
    with ``--wandb-group``, logged."""
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
    files = [
        *write_figures(rows, out, significant_settings(compared)),
        *write_tables(rows, out, args.at),
        *write_paired(compared, out),
        *write_headline(headline, out),
    ]
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
