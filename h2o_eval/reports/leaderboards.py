"""Leaderboards as kvpress draws its public one: per model, protocol and prompt length, the long-context headline's
mean over tasks as a table policy x compression ratio (1 − budget; the full cache's ceiling row first, then the
oracle's) in Markdown and CSV, and the figure of score against compression ratio."""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path
from typing import Any

from h2o_eval import stats
from h2o_eval.figures import save
from h2o_eval.reports.figures import BUDGET_SHARE, ORACLE_LABEL, REFERENCE_POLICIES, offset
from h2o_eval.reports.headline import (
    HEADLINE_KEYS,
    estimate_label,
    limits_label,
    questions_named,
    questions_note,
    task_order,
    tasks_label,
)
from h2o_eval.reports.tables import mean_kept, position, shared_note


def _ratio(budget: float) -> float:
    return round(1 - budget, 6)


def leaderboards(settings: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """The long-context settings grouped for leaderboards, one per (model, protocol, length): that protocol's
    settings, led by the full cache's (of that protocol when there is one, else of another: the full cache holds
    everything in any). Every cell of a leaderboard is a mean over the same tasks (:func:`_board_tasks`): a setting
    with more is narrowed to them, its ``left_out`` naming the others; a setting that lacks one of them (a run under
    way, a policy run on fewer tasks) is not a cell, and the first setting's ``missing`` names it."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for s in settings:
        if s["method"] != "full":
            groups.setdefault((s["model"], s["protocol"], s["length"]), []).append(s)
    for (model, protocol, length), group in groups.items():
        full = [s for s in settings if s["method"] == "full" and (s["model"], s["length"]) == (model, length)]
        group[:0] = sorted(full, key=lambda s: s["protocol"] != protocol)[:1]
        tasks = _board_tasks(group)
        kept, missing = [], []
        for s in group:
            (kept if tasks <= s["tasks"].keys() else missing).append(s)
        group[:] = [_narrowed(s, tasks) for s in kept]
        group[0] = {**group[0], "missing": missing}
    return groups


def _board_tasks(group: list[dict[str, Any]]) -> set[str]:
    """The tasks of a leaderboard: of the task sets its settings ran (within those of the full cache's ceiling),
    the one whose table holds the most scores (settings but the ceiling that ran all of its tasks x its tasks), the
    larger on a tie. So a policy run on one task more or one task fewer than the rest leaves the rest's board as it
    is."""
    ceiling = set(group[0]["tasks"]) if group[0]["method"] == "full" else {t for s in group for t in s["tasks"]}
    candidates = {frozenset(s["tasks"].keys() & ceiling) for s in group} - {frozenset()}

    def scores(tasks: frozenset[str]) -> tuple[int, int]:
        return sum(tasks <= s["tasks"].keys() for s in group if s["method"] != "full") * len(tasks), len(tasks)

    return set(max(sorted(candidates, key=sorted), key=scores))


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
        "kept": mean_kept({task: setting["kept_by_task"][task] for task in kept}),
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
    """What a leaderboard compares: its model, protocol and length, the settings its cells share and the documents
    each task was scored on (its ``limit``, or all of them)."""
    model, protocol, length = key
    limits = {task: limit for s in group for task, limit in s["limits"].items()}
    asked = questions_named({task: count for s in group for task, count in s["questions"].items()}, group[0]["shared"])
    note = ", ".join(filter(None, [shared_note(group), asked]))
    title = f"{model}, protocol {protocol}, {length} tokens" + (f", {note}" if note else "")
    return f"{title}, {limits_label(limits)}"


def _left_out_label(group: list[dict[str, Any]]) -> str:
    left_out = sorted({task for s in group for task in s.get("left_out", [])}, key=task_order)
    counts = [
        f"{task} (in {sum(task in s.get('left_out', []) for s in group)} of {len(group)} cells)" for task in left_out
    ]
    missing: dict[str, list[float]] = {}
    for s in group[0].get("missing", []):
        missing.setdefault(s["policy"], []).append(_ratio(position(s)))
    absent = [
        f"{policy} (ratio{'s' * (len(ratios) > 1)} {', '.join(f'{ratio:g}' for ratio in sorted(ratios))})"
        for policy, ratios in sorted(missing.items())
    ]
    return (f" Left out, not in every cell: {', '.join(counts)}." if counts else "") + (
        f" Not on this board, short of its tasks: {', '.join(absent)}." if absent else ""
    )


def leaderboard_markdown(key: tuple, group: list[dict[str, Any]]) -> str:
    """One leaderboard as a Markdown table: a row per policy (the full cache's ceiling first, the oracle next), a
    column per compression ratio, each cell the mean over the leaderboard's tasks x100 with its 95 % interval;
    the tasks some cells lack are named, with how many cells have them. Threshold runs follow in a table of their
    own, a row per threshold at the ratio it realised (the mean over the tasks)."""
    thresholds = [s for s in group if s.get("threshold")]
    board = [s for s in group if not s.get("threshold")]
    tasks = sorted({task for s in group for task in s["tasks"]}, key=task_order)
    ratios = sorted({_ratio(position(s)) for s in board if s["method"] != "full"})
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
    ]
    if ratios:
        lines += [
            "",
            "| policy | " + " | ".join(f"{ratio:g}" for ratio in ratios) + " |",
            "|---|" + "---:|" * len(ratios),
        ]
    for policy in _leaderboard_order(board) if ratios else []:
        cells = []
        for ratio in ratios:
            found = [
                s for s in board if s["policy"] == policy and (s["method"] == "full" or _ratio(position(s)) == ratio)
            ]
            cells.append(estimate_label(found[0]["mean"]) if found else "")
        name = {"full": "full (ceiling)", "oracle": ORACLE_LABEL}.get(policy, policy)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if thresholds:
        lines += [
            "",
            "Score thresholds (dms): a run evicts every token older than its window that scores below its threshold, "
            "whatever the budget; a row per threshold, at the compression ratio it realised (the mean over the "
            "tasks of the share of the context removed).",
            "",
            "| policy | compression ratio realised | score |",
            "|---|---:|---:|",
        ]
        for s in sorted(thresholds, key=lambda s: (s["threshold"], -position(s))):
            lines.append(f"| {s['policy']} | {_ratio(position(s)):.3f} | {estimate_label(s['mean'])} |")
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
            "ratio": _ratio(position(s)),
            "tasks": len(s["tasks"]),
            "score": round(s["mean"].value, 4),
            "low": round(s["mean"].low, 4),
            "high": round(s["mean"].high, 4),
            "documents": s["mean"].documents,
            "questions": s["mean"].n,
        }
        for policy in _leaderboard_order(group)
        for s in sorted((s for s in group if s["policy"] == policy), key=lambda s: -position(s))
    ]


MARKERS = ("o", "^", "v", "D", "P")  # the lines' markers: each round of the colour cycle takes the next


def leaderboard_figure(key: tuple, group: list[dict[str, Any]]) -> Any:
    """Score against compression ratio as kvpress's public plot draws it: a line per policy with its interval,
    the full cache a dashed reference and the oracle a dotted one; lines drawn slightly apart at each ratio, those
    that share a colour told apart by their markers. The threshold runs of one base are one dash-dotted line of
    squares through the ratios they realised. The ratio axis is a logit scale (:func:`_ratio_axis`)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))  # the legend beside takes 4 inches of it
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    oracle_drawn = "oracle" in {s["method"] for s in group}
    line = {s["policy"]: s.get("threshold") or s["policy"] for s in group}
    method = {line[s["policy"]]: s["method"] for s in group}
    policies = list(dict.fromkeys(line[p] for p in _leaderboard_order(group) if method[line[p]] != "full"))
    for s in group[:1] if group[0]["method"] == "full" else []:
        ax.axhline(s["mean"].value, color="black", linestyle="--", linewidth=1.2, label="full cache")
    for number, policy in enumerate(policies):
        points = sorted((s for s in group if line[s["policy"]] == policy), key=lambda s: -position(s))
        values = [s["mean"].value for s in points]
        oracle = method[policy] == "oracle"
        threshold = bool(points[0].get("threshold"))
        place = number - oracle_drawn  # in the colour cycle: the oracle draws in black
        ax.errorbar(
            [_ratio(position(s)) for s in points],
            values,
            yerr=[
                [v - s["mean"].low for v, s in zip(values, points, strict=True)],
                [s["mean"].high - v for v, s in zip(values, points, strict=True)],
            ],
            marker="s" if threshold else MARKERS[place // len(colors) % len(MARKERS)],
            markersize=4,
            capsize=3,
            color="black" if oracle else colors[place % len(colors)],
            linestyle=":" if oracle else "-." if threshold else "-",
            label=ORACLE_LABEL if oracle else policy,
            transform=offset(ax, number, len(policies)),
        )
    tasks = sorted({task for s in group for task in s["tasks"]}, key=task_order)
    _ratio_axis(ax, group)
    ax.set(
        xlabel=f"compression ratio (share of {BUDGET_SHARE[key[1]]} removed, 1 − budget)",
        ylabel=f"score (mean of {tasks_label(tasks)}, x100)",
        title=textwrap.fill(_leaderboard_title(key, group), 80),
        ylim=(-2, 102),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)  # beside: the axes keep width
    fig.tight_layout()
    return fig


def _ratio_axis(ax: Any, group: list[dict[str, Any]]) -> None:
    """The compression ratio axis: a logit scale, on which each halving of the budget near the top (0.875, 0.9375,
    0.96875) is a step as wide as 0.25 to 0.5, ticked at the ratios run (linear where a ratio is 0 or 1, which it
    cannot place)."""
    import math

    from matplotlib.ticker import NullFormatter, NullLocator

    ratios = sorted({_ratio(position(s)) for s in group if s["method"] != "full" and not s.get("threshold")})
    reached = [_ratio(position(s)) for s in group if s["method"] != "full"]
    if all(0 < ratio < 1 for ratio in reached):
        ax.set_xscale("logit")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        logit = [math.log(ratio / (1 - ratio)) for ratio in (min(reached), max(reached))]
        ax.set_xlim(*(1 / (1 + math.exp(-(x + margin))) for x, margin in zip(logit, (-0.5, 0.5), strict=True)))
    else:
        ax.set_xlim(min(reached) - 0.1, max(reached) + 0.1)
    if ratios:
        ax.set_xticks(ratios, [f"{ratio:g}" for ratio in ratios])


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
        files += save(leaderboard_figure(key, group), out / stem, dpi=150, bbox_inches="tight")
    return files, "\n".join(texts)
