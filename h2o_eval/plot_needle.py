"""RULER-style pictures of the long-context tasks (``python -m h2o_eval.plot --needle``): per model and task, a
heatmap of the score by needle depth and prompt length with one panel per (policy, budget, protocol), the full
cache's panel first as the ceiling, and the score against the prompt length, a line per setting.

They read the records that have a ``length`` (the RULER tasks of :mod:`h2o_eval.runners.long_context`) and the
per-document outputs beside them, where each document's depth and score are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from h2o_eval import figures, packs


def needle_rows(rows: list[dict[str, Any]], results_dir: Path) -> list[dict[str, Any]]:
    """One row per long-context row of :func:`h2o_eval.reports.tables.table` (a setting, its policy labelled as
    every report labels it) whose per-question outputs are in ``results_dir``: its setting, its metric
    (``string_match_all``, or ``string_match_part`` for RULER's qa tasks) and score, and its mean score and question
    count per needle depth (none for tasks without a needle)."""
    found = []
    for row in rows:
        if row["length"] is None or row["outputs"] is None:
            continue
        if (outputs := packs.outputs(results_dir / row["outputs"])) is None:
            continue
        by_depth: dict[float, list[float]] = {}
        for output in outputs:
            if output.get("depth") is not None:
                by_depth.setdefault(output["depth"], []).append(output["scores"][row["metric"]])
        found.append(
            {
                **{key: row[key] for key in ("model", "policy", "method", "budget", "protocol", "length", "metric")},
                "task": row["task"].rsplit("@", 1)[0],
                "score": row["value"],
                "depths": {depth: (sum(s) / len(s), len(s)) for depth, s in sorted(by_depth.items())},
            }
        )
    return found


def _panels(rows: list[dict[str, Any]]) -> list[tuple[str, float, str]]:
    """The (policy, budget, protocol) settings of ``rows``, the full cache first, then by policy and budget."""
    full = {r["policy"] for r in rows if r["method"] == "full"}
    return sorted({(r["policy"], r["budget"], r["protocol"]) for r in rows}, key=lambda p: (p[0] not in full, p))


def _label(policy: str, budget: float, protocol: str, protocols: int = 1) -> str:
    if policy == "full":
        return "full cache" if protocols == 1 else f"full cache ({protocol})"
    return f"{policy} {100 * budget:.3g}% ({protocol})"


def _length_label(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def heatmap(rows: list[dict[str, Any]]) -> Any:
    """Score by depth (rows) and length (columns) of one model and task, a panel per setting: a row of panels per
    policy (the full cache's first), its budgets and protocols side by side (a Figure)."""
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    depths = sorted({d for r in rows for d in r["depths"]})
    panels = _panels(rows)
    protocols = len({panel[2] for panel in panels})
    policies = list(dict.fromkeys(panel[0] for panel in panels))
    per_policy = [sorted((p for p in panels if p[0] == policy), key=lambda p: (p[2], p[1])) for policy in policies]
    columns = max(len(row) for row in per_policy)
    fig, axes = plt.subplots(
        len(policies),
        columns,
        figsize=(1.2 + max(2.2, 0.9 * len(lengths)) * columns, 0.8 + 2.6 * len(policies)),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    image = None
    for row_axes, row in zip(axes, per_policy, strict=True):
        for ax in row_axes[len(row) :]:
            ax.axis("off")
        for ax, panel in zip(row_axes, row, strict=False):
            cells = {
                (r["length"], d): v
                for r in rows
                if (r["policy"], r["budget"], r["protocol"]) == panel
                for d, v in r["depths"].items()
            }
            grid = [[cells.get((length, depth), (float("nan"), 0))[0] for length in lengths] for depth in depths]
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for i, depth in enumerate(depths):
                for j, length in enumerate(lengths):
                    if (length, depth) in cells:
                        ax.text(j, i, f"{cells[length, depth][0]:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [_length_label(length) for length in lengths])
            ax.set_yticks(range(len(depths)), [f"{depth:g}%" for depth in depths])
            ax.set_title(_label(*panel, protocols), fontsize=9)
        row_axes[0].set_ylabel("needle depth")
    for ax in axes[-1]:
        ax.set_xlabel("prompt length (tokens)")
    fig.colorbar(image, ax=axes.ravel().tolist(), label=rows[0]["metric"], fraction=0.05)
    fig.suptitle(f"{rows[0]['task']} – {rows[0]['model']}")
    return fig


def length_plot(rows: list[dict[str, Any]]) -> Any:
    """Score against prompt length of one model and task, a line per setting, the full cache dashed; one axis per
    protocol (a Figure)."""
    import matplotlib.pyplot as plt

    protocols = sorted({r["protocol"] for r in rows})
    fig, axes = plt.subplots(1, len(protocols), figsize=(6 * len(protocols), 4.5), squeeze=False, sharey=True)
    lengths = sorted({r["length"] for r in rows})
    for ax, protocol in zip(axes[0], protocols, strict=True):
        for panel in _panels([r for r in rows if r["protocol"] == protocol]):
            points = sorted(
                (r["length"], r["score"]) for r in rows if (r["policy"], r["budget"], r["protocol"]) == panel
            )
            full = panel[0] in {r["policy"] for r in rows if r["method"] == "full"}
            ax.plot(
                *zip(*points, strict=True),
                marker="o",
                label=_label(*panel),
                linestyle="--" if full else "-",
                color="black" if full else None,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_length_label(length) for length in lengths], minor=False)
        ax.set(xlabel="prompt length (tokens)", ylabel=rows[0]["metric"], ylim=(-0.02, 1.02))
        ax.set_title(f"{rows[0]['task']} – {rows[0]['model']} ({protocol})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def write(table_rows: list[dict[str, Any]], results_dir: Path, out: Path) -> list[Path]:
    """Both figures (PNG, PDF) per model and task of :func:`h2o_eval.reports.tables.table`'s long-context rows
    under ``out``: ``needle_<task>_<model>`` (tasks with a needle) and ``length_<task>_<model>``. Returns the files
    written."""
    rows = needle_rows(table_rows, results_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for model, task in sorted({(r["model"], r["task"]) for r in rows}):
        chosen = [r for r in rows if (r["model"], r["task"]) == (model, task)]
        drawn = {"length": length_plot(chosen)}
        if any(r["depths"] for r in chosen):
            drawn["needle"] = heatmap(chosen)
        for kind, fig in drawn.items():
            files += figures.save(fig, out / f"{kind}_{task}_{model}", dpi=150, bbox_inches="tight")
    return files
