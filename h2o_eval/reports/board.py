"""The reasoning board in the layout of the field's papers (R-KV, TriAttention): per task and model, the budget in
tokens as rows and a column per policy, the full cache's first (and a threshold's, whose budget is no setting, the
same in every row), for each measure of the board: agreement with the full cache (with its count of problems), the
trace kept whole, accuracy, the generated length, the share of solutions in each class (answered, unanswered text,
blank, a loop, cut at the limit) and the share that evicted. A cell
whose cache evicted nothing in any problem says so instead of a score. Written as ``board.md`` by ``python -m
h2o_eval.plot DIR --board``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from h2o_eval.reports.tables import table

MEASURES = {  # metric: (its title, digits, whether a cell says its count of problems)
    "agreement": ("agreement with the full cache's final answer (problems compared)", 2, True),
    "same_trace": ("the full cache's trace kept whole (problems compared)", 2, True),
    "accuracy": ("accuracy", 2, False),
    "generated_tokens": ("generated tokens (mean)", 0, False),
    "answered": ("solutions with a final answer", 2, False),
    "unanswered": ("solutions of text without one", 2, False),
    "blank": ("blank solutions", 2, False),
    "loop": ("solutions that loop to the limit", 2, False),
    "cut": ("solutions cut at the limit", 2, False),
    "evicted": ("problems whose cache let a token go", 2, False),
}


def board_markdown(records: list[dict[str, Any]]) -> str:
    """The board's tables of ``records``: those at budgets in tokens, and those whose budget is no setting (the full
    cache; a threshold's, ``dms``), which fill a column of every row."""
    tables: dict[tuple[str, str], list[str]] = {}
    for metric, (title, digits, counted) in MEASURES.items():
        rows = [r for r in table(records, metric) if _everywhere(r) or isinstance(r["budget"], int)]
        for (task, model), group in _groups(rows).items():
            tables.setdefault((task, model), []).append(f"{title}:\n\n{_table(group, digits, counted)}")
    return "\n".join(f"## {task}, {model}\n\n" + "\n".join(found) for (task, model), found in tables.items())


def _everywhere(row: dict[str, Any]) -> bool:
    """Whether a row holds at every budget: the full cache's, or a threshold's (its budget is no setting)."""
    return row["method"] == "full" or row["kept"] is not None


def write_board(records: list[dict[str, Any]], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "board.md").write_text(board_markdown(records))
    return [out / "board.md"]


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The rows by task (with the task's settings that depart from the defaults) and model."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        task = row["task"] + (f" ({', '.join(row['task_settings'])})" if row["task_settings"] else "")
        groups.setdefault((task, row["model"]), []).append(row)
    return groups


def _table(rows: list[dict[str, Any]], digits: int, counted: bool) -> str:
    full = next((r for r in rows if r["method"] == "full"), None)
    policies = sorted({r["policy_in_task"] for r in rows if r["method"] != "full"})
    budgets = sorted({r["budget"] for r in rows if not _everywhere(r)})
    cells = {(r["budget"], r["policy_in_task"]): r for r in rows if not _everywhere(r)}
    always = {r["policy_in_task"]: r for r in rows if _everywhere(r) and r["method"] != "full"}
    lines = ["| budget | full | " + " | ".join(policies) + " |", "|---:|---:|" + "---:|" * len(policies)]
    for budget in budgets:
        values = [_cell(full, digits, counted)]
        values += [_cell(always.get(policy, cells.get((budget, policy))), digits, counted) for policy in policies]
        lines.append(f"| {budget} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def _cell(row: dict[str, Any] | None, digits: int, counted: bool) -> str:
    """A cell: the value, with its count of problems where ``counted`` (agreement: ``0.62 (50)``); "no eviction" for
    a cell that evicted nothing; empty without a record."""
    if row is None:
        return ""
    if row["no_eviction"]:
        return "no eviction"
    return f"{row['value']:.{digits}f}" + (f" ({row['n_samples']})" if counted else "")
