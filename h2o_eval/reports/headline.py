"""The long-context headline (``headline.md``): per setting (model, protocol, length, policy, budget), each task's
score x100 with its document-bootstrap interval and the unweighted mean over tasks, RULER's and kvpress's headline
number, whose interval resamples documents within each task; and how reports name the tasks, limits and questions
per context a mean covers."""

from __future__ import annotations

import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from h2o_eval import stats
from h2o_eval.reports.tables import limit_label, limit_order, mean_kept, percent, policies_per_task
from h2o_eval.settings import questions_label

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


def task_order(task: str) -> tuple[int, str]:
    """A sort key for task names: RULER's thirteen in RULER's order, then any other by name."""
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
                "threshold": row.get("threshold"),
                "shared": row["shared"],
                "tasks": {},
                "scores": {},
                "limits": {},
                "questions": {},
                "kept_by_task": {},
            },
        )
        task = row["task"].rsplit("@", 1)[0]
        limits.setdefault((row["model"], row["length"], task), set()).add(row["limit"])
        setting["limits"][task] = row["limit"]
        setting["kept_by_task"][task] = row.get("kept")
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
        setting["tasks"] = dict(sorted(setting["tasks"].items(), key=lambda item: task_order(item[0])))
        setting["mean"] = stats.mean_over_tasks([setting["scores"][task] for task in setting["tasks"]])
        setting["kept"] = mean_kept(setting["kept_by_task"])
    return sorted(
        settings.values(),
        key=lambda s: (s["model"], s["protocol"], s["length"], s["method"] != "full", s["policy"], -s["budget"]),
    )


def limits_label(limits: dict[str, int | float | None]) -> str:
    """The documents each task was scored on: "limit=5" when they share it, else the most common limit and the
    tasks of each other one ("limit=5; cwe, fwe, qa_2: 20")."""
    tasks: dict[int | float | None, list[str]] = {}
    for task in sorted(limits, key=task_order):
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
    for task in sorted(asked, key=task_order):
        if asked[task] is not None:
            tasks.setdefault(asked[task], []).append(task)
    if not tasks:
        return ""
    common = max(tasks, key=lambda count: len(tasks[count]))
    others = [f"{', '.join(named)}: {count}" for count, named in tasks.items() if count != common]
    return questions_label(common) + (f" ({'; '.join(others)})" if others else "")


def questions_named(asked: dict[str, int | None], shared: Collection[str]) -> str:
    """:func:`questions_note` of ``asked``, or "" when the settings every row shares already name it."""
    note = questions_note(asked)
    return "" if note in shared else note


def estimate_label(estimate: stats.Estimate) -> str:
    """A score x100 as the headline and the leaderboards print it: "62.5 [40.0, 85.0]"."""
    return f"{estimate.value:.1f} [{estimate.low:.1f}, {estimate.high:.1f}]"


def headline_markdown(settings: list[dict[str, Any]]) -> str:
    """The long-context headline as a Markdown table: per setting the mean over tasks and each task's score."""
    tasks = sorted({task for s in settings for task in s["tasks"]}, key=task_order)
    limits = len({limits_label(s["limits"]) for s in settings}) > 1
    asked = {questions_named(s["questions"], s["shared"]) for s in settings}
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
            *([questions_named(s["questions"], s["shared"])] if len(asked) > 1 else []),
        ]
        model = f"{s['model']} ({'; '.join(filter(None, named))})" if any(named) else s["model"]
        cells = [estimate_label(s["tasks"][task]) if task in s["tasks"] else "" for task in tasks]
        lines.append(
            f"| {model} | {s['protocol']} | {s['length']} | {s['policy']} | {percent(s['budget'])} "
            f"| {estimate_label(s['mean'])} | {tasks_label(s['tasks'])} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def write_headline(settings: list[dict[str, Any]], out: Path) -> list[Path]:
    """:func:`headline_markdown` of the ``settings`` of :func:`long_context` as ``out``/headline.md (nothing when
    there are none); returns the files."""
    if not settings:
        return []
    out.mkdir(parents=True, exist_ok=True)
    path = out / "headline.md"
    path.write_text(headline_markdown(settings))
    return [path]
