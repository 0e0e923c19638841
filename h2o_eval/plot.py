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
import csv
import sys
import textwrap
from collections import Counter
from collections.abc import Collection
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from h2o_eval import figures, plot_needle, stats
from h2o_eval.reports.paired import paired_markdown, paired_rows, significant_settings, write_paired
from h2o_eval.reports.tables import (
    COLUMNS,
    compute,
    limit_label,
    limit_order,
    markdown,
    mixed_limits,
    percent,
    policies_per_task,
    setting_key,
    shared_note,
    side_by_side,
    table,
    write_tables,
)
from h2o_eval.results import read_records
from h2o_eval.settings import questions_label, report_labels

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "accuracy_vs_budget.ipynb"

BUDGET_SHARE = {"simulate": "the sequence", "prefill": "the prompt", "context": "the context"}
REFERENCE_POLICIES = ("full", "oracle")
ORACLE_LABEL = "oracle (not deployable)"


def budget_label(protocols: list[str], what: str = "KV cache budget") -> str:
    """The budget axis's label: what the budget is a share of, by protocol (each named when there are several)."""
    if len(protocols) == 1:
        return f"{what} (% of {BUDGET_SHARE[protocols[0]]})"
    return f"{what} (% of " + ", of ".join(f"{BUDGET_SHARE[p]} for {p}" for p in protocols) + ")"


def _offset(ax: Any, index: int, count: int, points: float = 3.0) -> Any:
    """A data transform that draws line ``index`` of ``count`` shifted sideways by a few points, so that points
    of different lines at one x stay apart; the data keep their true x."""
    from matplotlib.transforms import ScaledTranslation

    shift = (index - (count - 1) / 2) * points / 72
    return ax.transData + ScaledTranslation(shift, 0, ax.figure.dpi_scale_trans)


def figure(rows: list[dict[str, Any]], task: str, significant: frozenset[tuple] = frozenset()) -> Any:
    """The accuracy-vs-budget figure of one task (a matplotlib Figure). The full cache is a dashed horizontal
    reference and the oracle a dotted line, per model; the other policies' lines are drawn slightly apart at each
    budget. Records scored on different ``limit``s are never joined: each limit gets lines of its own, named in
    the legend. Points whose setting (see :func:`_setting`) is in ``significant`` are ringed: they differ from
    the full cache beyond chance."""
    import matplotlib.pyplot as plt

    rows = [{**r, "ringed": setting_key(r) in significant} for r in rows if r["task"] == task]
    asked = _questions_of_task(rows)
    if asked:  # the task's one count of questions per context goes in the title, not in every line's label
        rows = [{**r, "policy": r["policy_without_questions"]} for r in rows]
    if task in mixed_limits(rows):  # a (model, limit) pair is drawn as a model of its own
        rows = [{**r, "model": f"{r['model']}, {limit_label(r['limit'])}"} for r in rows]
    models = sorted({r["model"] for r in rows})
    protocols = sorted({r["protocol"] for r in rows if r["method"] != "full"} or {r["protocol"] for r in rows})
    method = {r["policy"]: r["method"] for r in rows}
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = [
        (model, policy, protocol)
        for model in models
        for policy, protocol in sorted({(r["policy"], r["protocol"]) for r in rows if r["model"] == model})
        if method[policy] != "full"
    ]
    for index, model in enumerate(models):
        shade = str(0.45 * index / max(len(models) - 1, 1))  # black, then greys: one reference shade per model
        full = [r for r in rows if r["model"] == model and r["method"] == "full"]
        if full:
            label = "full cache" if len(models) == 1 else f"{model}: full cache"
            ax.axhline(full[0]["value"], color=shade, linestyle="--", linewidth=1, label=label)
        lines = [line for line in drawn if line[0] == model]
        for number, (_, policy, protocol) in enumerate(sorted(lines, key=lambda line: method[line[1]] == "oracle")):
            points = [r for r in rows if (r["model"], r["policy"], r["protocol"]) == (model, policy, protocol)]
            label = (
                (ORACLE_LABEL if policy == "oracle" else policy)
                + (f" ({protocol})" if len(protocols) > 1 else "")
                + (f" – {model}" if len(models) > 1 else "")
            )
            oracle = method[policy] == "oracle"
            color = shade if oracle else colors[number % len(colors)]
            transform = _offset(ax, drawn.index((model, policy, protocol)), len(drawn))
            ax.errorbar(
                [100 * p["budget"] for p in points],
                [p["value"] for p in points],
                yerr=[p["stderr"] or 0.0 for p in points],
                marker="o",
                markersize=4 if oracle else 6,
                capsize=3,
                color=color,
                linestyle=":" if oracle else "-" if index == 0 else "-.",
                label=label,
                transform=transform,
            )
            ax.update_datalim(  # an offset transform keeps the points out of autoscaling
                [(100 * p["budget"], p["value"] + sign * (p["stderr"] or 0.0)) for p in points for sign in (-1, 1)]
            )
            ringed = [p for p in points if p["ringed"]]
            ax.scatter(
                [100 * p["budget"] for p in ringed],
                [p["value"] for p in ringed],
                s=160,
                facecolors="none",
                edgecolors=color,
                label="_ringed",
            ).set_offset_transform(transform)
    if any(r["ringed"] for r in rows):
        ax.scatter([], [], s=160, facecolors="none", edgecolors="grey", label=f"differs from full (p < {stats.ALPHA})")
    metric = rows[0]["metric"] if rows else ""
    ax.autoscale_view()
    note = ", ".join([*(rows[0]["shared"] if rows else ()), *([asked] if asked else [])])
    title = f"{task} ({note})" if note else task
    ax.set(xlabel=budget_label(protocols), ylabel=metric, title=textwrap.fill(title, 60), xlim=(0, 100))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)

HEADLINE_KEYS = ("model", "protocol", "length", "policy", "budget")


def tasks_label(tasks: Collection[str]) -> str:
    """What a mean over ``tasks`` covers: "13 tasks" for RULER's thirteen, "k/13 tasks" for fewer of them, and
    how many of RULER's are among them when other tasks are too."""
    ruler = [task for task in tasks if task in RULER_TASKS]
    if len(ruler) < len(tasks):
        return f"{len(tasks)} tasks ({len(ruler)}/{len(RULER_TASKS)} of RULER's)"
    return f"{len(ruler)} tasks" if len(ruler) == len(RULER_TASKS) else f"{len(ruler)}/{len(RULER_TASKS)} tasks"


def _task_order(task: str) -> tuple[int, str]:
    return (RULER_TASKS.index(task) if task in RULER_TASKS else len(RULER_TASKS)), task


def long_context(rows: list[dict[str, Any]], results_dir: Path) -> list[dict[str, Any]]:
    """The headline of each long-context setting (model, protocol, length, policy, budget): ``tasks``, each
    task's score x100 (its own metric) as a :class:`~h2o_eval.stats.Estimate` with its document-bootstrap
    interval, ``limits``, each task's ``limit`` (tasks may be scored on different document counts, as the
    leaderboard preset scores cwe, fwe and qa_2), and ``mean``, the unweighted mean of those scores, whose
    interval resamples documents within each task; ``scores`` keeps each task's (scores x100, documents) for a
    mean over fewer tasks. Records without per-question outputs are left out, with a note. Raises ValueError
    when a task of one model and length was scored on several limits: which documents stand for it is not the
    headline's to choose."""
    settings: dict[tuple, dict[str, Any]] = {}
    limits: dict[tuple, set] = {}
    for row, policy in zip(rows, policies_per_task(rows), strict=True):
        if row["length"] is None:
            continue
        scores = stats.question_scores(row, results_dir, row["metric"])
        if not scores:
            print(f"note: {row['task']} {row['policy']} has no per-question outputs: left out", file=sys.stderr)
            continue
        key = (row["model"], row["protocol"], row["length"], policy, row["budget"])
        setting = settings.setdefault(
            key,
            {
                **dict(zip(HEADLINE_KEYS, key, strict=True)),
                "method": row["method"],
                "shared": row["shared"],
                "tasks": {},
                "scores": {},
                "limits": {},
                "questions": {},
            },
        )
        task = row["task"].rsplit("@", 1)[0]
        limits.setdefault((row["model"], row["length"], task), set()).add(row["limit"])
        setting["limits"][task] = row["limit"]
        if policy == row["policy_without_questions"]:
            setting["questions"][task] = row["questions"]
        documents, values = zip(*scores.values(), strict=True)
        setting["scores"][task] = ([100 * value for value in values], list(documents))
        setting["tasks"][task] = stats.estimate(*setting["scores"][task])
    for (model, length, task), found in limits.items():
        if len(found) > 1:
            raise ValueError(
                f"{task} of {model} at {length} tokens was scored on "
                f"{' and '.join(map(limit_label, sorted(found, key=limit_order)))}: "
                "give each limit's records a results dir of its own"
            )
    for setting in settings.values():
        setting["tasks"] = dict(sorted(setting["tasks"].items(), key=lambda item: _task_order(item[0])))
        setting["mean"] = stats.mean_over_tasks([setting["scores"][task] for task in setting["tasks"]])
    return sorted(
        settings.values(),
        key=lambda s: (s["model"], s["protocol"], s["length"], s["method"] != "full", s["policy"], -s["budget"]),
    )


def limits_label(limits: dict[str, int | float | None]) -> str:
    """The documents each task was scored on: "limit=5" when they share it, else the most common limit and the
    tasks of each other one ("limit=5; cwe, fwe, qa_2: 20")."""
    tasks: dict[int | float | None, list[str]] = {}
    for task in sorted(limits, key=_task_order):
        tasks.setdefault(limits[task], []).append(task)
    common = max(tasks, key=lambda limit: len(tasks[limit]))
    others = [
        f"{', '.join(named)}: {limit_label(limit).removeprefix('limit=')}"
        for limit, named in tasks.items()
        if limit != common
    ]
    return "; ".join([limit_label(common), *others])


def questions_note(asked: dict[str, int | None]) -> str:
    """The questions per context each task was asked: "4 questions per context" when the tasks share it, else the
    most common count and the tasks of each other one ("4 questions per context (cwe, fwe, qa_2: 1)"); "" when
    none is known."""
    tasks: dict[int, list[str]] = {}
    for task in sorted(asked, key=_task_order):
        if asked[task] is not None:
            tasks.setdefault(asked[task], []).append(task)
    if not tasks:
        return ""
    common = max(tasks, key=lambda count: len(tasks[count]))
    others = [f"{', '.join(named)}: {count}" for count, named in tasks.items() if count != common]
    return questions_label(common) + (f" ({'; '.join(others)})" if others else "")


def _questions_named(asked: dict[str, int | None], shared: Collection[str]) -> str:
    """:func:`questions_note` of ``asked``, or "" when the settings every row shares already name it."""
    note = questions_note(asked)
    return "" if note in shared else note


def _questions_of_task(rows: list[dict[str, Any]]) -> str:
    """The one count of questions per context that every row of one task was asked, for its figure's title ("" when
    the rows differ in it, so that their labels tell them apart, or when every report row shares it)."""
    counts = {r["questions"] for r in rows}
    if len(counts) != 1 or None in counts or not rows:
        return ""
    return _questions_named({rows[0]["task"]: rows[0]["questions"]}, rows[0]["shared"])


def _estimate(estimate: stats.Estimate) -> str:
    return f"{estimate.value:.1f} [{estimate.low:.1f}, {estimate.high:.1f}]"


def headline_markdown(settings: list[dict[str, Any]]) -> str:
    """The long-context headline as a Markdown table: per setting the mean over tasks and each task's score."""
    tasks = sorted({task for s in settings for task in s["tasks"]}, key=_task_order)
    limits = len({limits_label(s["limits"]) for s in settings}) > 1
    asked = {_questions_named(s["questions"], s["shared"]) for s in settings}
    every = [*(settings[0]["shared"] if settings else ()), *(asked if len(asked) == 1 else ())]
    lines = [
        "Long context: each task's score x100 (RULER's metric: string_match_all, string_match_part for qa) with "
        f"its 95 % interval resampling documents ({stats.RESAMPLES:,} resamples, seed {stats.SEED}); mean: the "
        "unweighted mean of the task scores (RULER's and kvpress's headline), its interval resampling documents "
        "within each task." + (f" Every row: {', '.join(filter(None, every))}." if any(every) else ""),
        "",
        "| model | protocol | length | policy | budget | mean [95 % CI] | tasks | " + " | ".join(tasks) + " |",
        "|---|---|---:|---|---:|---|---|" + "---|" * len(tasks),
    ]
    for s in settings:
        named = [
            *([limits_label(s["limits"])] if limits else []),
            *([_questions_named(s["questions"], s["shared"])] if len(asked) > 1 else []),
        ]
        model = f"{s['model']} ({'; '.join(filter(None, named))})" if any(named) else s["model"]
        cells = [_estimate(s["tasks"][task]) if task in s["tasks"] else "" for task in tasks]
        lines.append(
            f"| {model} | {s['protocol']} | {s['length']} | {s['policy']} | {percent(s['budget'])} "
            f"| {_estimate(s['mean'])} | {tasks_label(s['tasks'])} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def _ratio(budget: float) -> float:
    return round(1 - budget, 6)


def leaderboards(settings: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """The long-context settings grouped for leaderboards, one per (model, protocol, length): that protocol's
    settings, led by the full cache's (of that protocol when there is one, else of another: the full cache holds
    everything in any). Every cell of a leaderboard is a mean over the same tasks, those all its settings have:
    a setting with more is narrowed to them, its ``left_out`` naming the others (a run under way, a policy not
    run on a task). Raises ValueError when its settings share no task."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for s in settings:
        if s["method"] != "full":
            groups.setdefault((s["model"], s["protocol"], s["length"]), []).append(s)
    for (model, protocol, length), group in groups.items():
        full = [s for s in settings if s["method"] == "full" and (s["model"], s["length"]) == (model, length)]
        group[:0] = sorted(full, key=lambda s: s["protocol"] != protocol)[:1]
        shared = set.intersection(*(set(s["tasks"]) for s in group))
        if not shared:
            raise ValueError(
                f"the leaderboard of {model}, protocol {protocol}, {length} tokens has no task that every policy ran "
                "at every ratio: run the missing cells, or plot fewer policies or tasks (--model, --task)"
            )
        group[:] = [_narrowed(s, shared) for s in group]
    return groups


def _narrowed(setting: dict[str, Any], tasks: set[str]) -> dict[str, Any]:
    left_out = [task for task in setting["tasks"] if task not in tasks]
    if not left_out:
        return {**setting, "left_out": []}
    kept = [task for task in setting["tasks"] if task in tasks]
    return {
        **setting,
        "tasks": {task: setting["tasks"][task] for task in kept},
        "limits": {task: setting["limits"][task] for task in kept},
        "questions": {task: count for task, count in setting["questions"].items() if task in kept},
        "scores": {task: setting["scores"][task] for task in kept},
        "mean": stats.mean_over_tasks([setting["scores"][task] for task in kept]),
        "left_out": left_out,
    }


def _leaderboard_order(group: list[dict[str, Any]]) -> list[str]:
    """The policies' labels in a leaderboard's order: the full cache, the oracle, then the rest by label."""

    def rank(s: dict[str, Any]) -> tuple[int, str]:
        method = s["method"]
        return (REFERENCE_POLICIES.index(method) if method in REFERENCE_POLICIES else len(REFERENCE_POLICIES)), s[
            "policy"
        ]

    return list(dict.fromkeys(s["policy"] for s in sorted(group, key=rank)))


def _leaderboard_title(key: tuple, group: list[dict[str, Any]]) -> str:
    model, protocol, length = key
    limits = {task: limit for s in group for task, limit in s["limits"].items()}
    named = any(limit is not None for limit in limits.values())
    asked = _questions_named({task: count for s in group for task, count in s["questions"].items()}, group[0]["shared"])
    note = ", ".join(filter(None, [shared_note(group), asked]))
    title = f"{model}, protocol {protocol}, {length} tokens" + (f", {note}" if note else "")
    return title + (f", {limits_label(limits)}" if named else "")


def _left_out_label(group: list[dict[str, Any]]) -> str:
    left_out = sorted({task for s in group for task in s.get("left_out", [])}, key=_task_order)
    if not left_out:
        return ""
    counts = [
        f"{task} (in {sum(task in s.get('left_out', []) for s in group)} of {len(group)} cells)" for task in left_out
    ]
    return f" Left out, not in every cell: {', '.join(counts)}."


def leaderboard_markdown(key: tuple, group: list[dict[str, Any]]) -> str:
    """One leaderboard as a Markdown table: a row per policy (the full cache's ceiling first, the oracle next), a
    column per compression ratio, each cell the mean over the leaderboard's tasks x100 with its 95 % interval;
    the tasks some cells lack are named, with how many cells have them."""
    tasks = sorted({task for s in group for task in s["tasks"]}, key=_task_order)
    ratios = sorted({_ratio(s["budget"]) for s in group if s["method"] != "full"})
    lines = [
        f"Leaderboard: {_leaderboard_title(key, group)}. Each cell: the unweighted mean over tasks of the score "
        f"x100 with its 95 % interval resampling documents within each task ({stats.RESAMPLES:,} resamples, seed "
        f"{stats.SEED}); compression ratio = 1 − budget (kvpress's convention: the share of the "
        f"{BUDGET_SHARE[key[1]].split()[-1]} removed). Tasks: {tasks_label(tasks)} ({', '.join(tasks)})."
        + _left_out_label(group)
        + (" full: the full cache, the ceiling, the same at every ratio." if group[0]["method"] == "full" else "")
        + (
            " oracle: compression by the attention of the question and the full cache's answer, not deployable."
            if any(s["method"] == "oracle" for s in group)
            else ""
        ),
        "",
        "| policy | " + " | ".join(f"{ratio:g}" for ratio in ratios) + " |",
        "|---|" + "---:|" * len(ratios),
    ]
    for policy in _leaderboard_order(group):
        cells = []
        for ratio in ratios:
            found = [
                s for s in group if s["policy"] == policy and (s["method"] == "full" or _ratio(s["budget"]) == ratio)
            ]
            cells.append(_estimate(found[0]["mean"]) if found else "")
        name = {"full": "full (ceiling)", "oracle": ORACLE_LABEL}.get(policy, policy)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


LEADERBOARD_COLUMNS = (
    "model",
    "protocol",
    "length",
    "limits",
    "per_context",
    "policy",
    "budget",
    "ratio",
    "tasks",
    "score",
    "low",
    "high",
    "documents",
    "questions",
)


def leaderboard_rows(group: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One leaderboard's cells as CSV rows (the full cache's at its own budget, ratio 0)."""
    return [
        {
            **{key: s[key] for key in HEADLINE_KEYS},
            "limits": limits_label(s["limits"]),
            "per_context": questions_note(s["questions"]),
            "ratio": _ratio(s["budget"]),
            "tasks": len(s["tasks"]),
            "score": round(s["mean"].value, 4),
            "low": round(s["mean"].low, 4),
            "high": round(s["mean"].high, 4),
            "documents": s["mean"].documents,
            "questions": s["mean"].n,
        }
        for policy in _leaderboard_order(group)
        for s in sorted((s for s in group if s["policy"] == policy), key=lambda s: -s["budget"])
    ]


def leaderboard_figure(key: tuple, group: list[dict[str, Any]]) -> Any:
    """Score against compression ratio as kvpress's public plot draws it: a line per policy with its interval,
    the full cache a dashed reference and the oracle a dotted one; lines drawn slightly apart at each ratio."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    method = {s["policy"]: s["method"] for s in group}
    policies = [p for p in _leaderboard_order(group) if method[p] != "full"]
    for s in group[:1] if group[0]["method"] == "full" else []:
        ax.axhline(s["mean"].value, color="black", linestyle="--", linewidth=1.2, label="full cache")
    for number, policy in enumerate(policies):
        points = sorted((s for s in group if s["policy"] == policy), key=lambda s: -s["budget"])
        values = [s["mean"].value for s in points]
        oracle = method[policy] == "oracle"
        ax.errorbar(
            [_ratio(s["budget"]) for s in points],
            values,
            yerr=[
                [v - s["mean"].low for v, s in zip(values, points, strict=True)],
                [s["mean"].high - v for v, s in zip(values, points, strict=True)],
            ],
            marker="o",
            markersize=4,
            capsize=3,
            color="black" if oracle else colors[(number - ("oracle" in method.values())) % len(colors)],
            linestyle=":" if oracle else "-",
            label=ORACLE_LABEL if oracle else policy,
            transform=_offset(ax, number, len(policies)),
        )
    tasks = sorted({task for s in group for task in s["tasks"]}, key=_task_order)
    ratios = sorted({_ratio(s["budget"]) for s in group if s["method"] != "full"})
    ax.set_xticks(ratios, [f"{ratio:g}" for ratio in ratios])
    ax.set_xlim(min(ratios) - 0.1, max(ratios) + 0.1)
    ax.set(
        xlabel=f"compression ratio (share of {BUDGET_SHARE[key[1]]} removed, 1 − budget)",
        ylabel=f"score (mean of {tasks_label(tasks)}, x100)",
        title=textwrap.fill(_leaderboard_title(key, group), 80),
        ylim=(-2, 102),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, frameon=False)
    fig.tight_layout()
    return fig


def write_leaderboards(settings: list[dict[str, Any]], out: Path) -> tuple[list[Path], str]:
    """Each leaderboard of :func:`leaderboards` under ``out`` as ``leaderboard_<model>_<protocol>_<length>``
    .md, .csv, .png and .pdf; returns the files and the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    files, texts = [], []
    for key, group in leaderboards(settings).items():
        stem = "leaderboard_" + "_".join(map(str, key))
        texts.append(leaderboard_markdown(key, group))
        files.append(out / f"{stem}.md")
        files[-1].write_text(texts[-1])
        files.append(out / f"{stem}.csv")
        with files[-1].open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=LEADERBOARD_COLUMNS)
            writer.writeheader()
            writer.writerows(leaderboard_rows(group))
        files += figures.save(leaderboard_figure(key, group), out / stem, dpi=150, bbox_inches="tight")
    return files, "\n".join(texts)


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
    :func:`long_context` in ``headline.md``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    compared = compared or []
    significant = significant_settings(compared)
    for task in sorted({r["task"] for r in rows}):
        written += figures.save(figure(rows, task, significant), out / task, dpi=150)
    written += write_tables(rows, out, at)
    written += write_paired(compared, out)
    if headline:
        written.append(out / "headline.md")
        written[-1].write_text(headline_markdown(headline))
    return written


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
            tasks = sorted({r["task"] for r in mine}, key=_task_order)
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
