"""Accuracy (or ROUGE) against the KV budget, one figure per task: a line per (model, policy, protocol) with
lm-eval's stderr as error bars, the full cache of each model a dashed reference and the oracle a dotted line, the
budget in percent of what it is a share of (the sequence, the prompt or the context, by protocol), points of
different lines at one budget drawn slightly apart and the significant ones ringed."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from h2o_eval import stats
from h2o_eval.figures import save
from h2o_eval.reports.headline import questions_named
from h2o_eval.reports.tables import limit_label, limit_order, mixed_limits, position, setting_key

BUDGET_SHARE = {"simulate": "the sequence", "prefill": "the prompt", "context": "the context"}
REFERENCE_POLICIES = ("full", "oracle")
ORACLE_LABEL = "oracle (not deployable)"


def budget_label(protocols: list[str], what: str = "KV cache budget") -> str:
    """The budget axis's label: what the budget is a share of, by protocol (each named when there are several)."""
    if len(protocols) == 1:
        return f"{what} (% of {BUDGET_SHARE[protocols[0]]})"
    return f"{what} (% of " + ", of ".join(f"{BUDGET_SHARE[p]} for {p}" for p in protocols) + ")"


SPREAD = 16.0  # the most points the lines at one x are spread over, however many: they stay by their x


def offset(ax: Any, index: int, count: int, points: float = 3.0) -> Any:
    """A data transform that draws line ``index`` of ``count`` shifted sideways by a few points (fewer when many
    lines would spread past :data:`SPREAD`), so that points of different lines at one x stay apart; the data keep
    their true x."""
    from matplotlib.transforms import ScaledTranslation

    points = min(points, SPREAD / max(count - 1, 1))
    shift = (index - (count - 1) / 2) * points / 72
    return ax.transData + ScaledTranslation(shift, 0, ax.figure.dpi_scale_trans)


def figure(rows: list[dict[str, Any]], task: str, significant: frozenset[tuple] = frozenset()) -> Any:
    """The accuracy-vs-budget figure of one task (a matplotlib Figure). The full cache is a dashed horizontal
    reference and the oracle a dotted line, per model; the other policies' lines are drawn slightly apart at each
    budget. Records scored on different ``limit``s are never joined: each limit gets lines of its own, named in
    the legend. Points whose setting (see :func:`~h2o_eval.reports.tables.setting_key`) is in ``significant`` are
    ringed: they differ from the full cache beyond chance."""
    import matplotlib.pyplot as plt

    title = _title(rows, task)
    rows, asked = _task_rows(rows, task, significant)
    tokens = in_tokens(rows)
    if not tokens:  # a budget in tokens has no place on an axis of fractions
        rows = [r for r in rows if not isinstance(r["budget"], int) or r["kept"] is not None]
    models = sorted({r["model"] for r in rows})
    protocols = sorted({r["protocol"] for r in rows if r["method"] != "full"} or {r["protocol"] for r in rows})
    method = {r["policy"]: r["method"] for r in rows}
    drawn = [
        (model, policy, protocol)
        for model in models
        for policy, protocol in sorted({(r["policy"], r["protocol"]) for r in rows if r["model"] == model})
        if method[policy] != "full"
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    for index in range(len(models)):
        _draw_model(ax, rows, drawn, index, models, protocols, tokens)
    if any(r["ringed"] for r in rows):
        ax.scatter([], [], s=160, facecolors="none", edgecolors="grey", label=f"differs from full (p < {stats.ALPHA})")
    metric = rows[0]["metric"] if rows else ""
    ax.autoscale_view()
    note = ", ".join([*(rows[0]["shared"] if rows else ()), *([asked] if asked else [])])
    title += f" ({note})" if note else ""
    ax.set(ylabel=metric, title=textwrap.fill(title, 60))
    if tokens:
        budgets = sorted({r["budget"] for r in rows if isinstance(r["budget"], int)})
        ax.set(xlabel="KV cache budget (tokens, the prompt and the generation's)", xscale="log", xlim=None)
        ax.set_xticks(budgets, [str(budget) for budget in budgets])
        ax.xaxis.set_minor_formatter("")
    else:
        ax.set(xlabel=budget_label(protocols), xlim=(0, 100))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def in_tokens(rows: list[dict[str, Any]]) -> bool:
    """Whether a figure's budgets are counts of tokens (the reasoning tasks'), not fractions: every run's but the
    full cache's and a threshold's. Its x axis then counts tokens (logarithmic), and a threshold run stands at the
    tokens it held. Where budgets of both kinds meet, the figure draws the fractions."""
    budgets = [r["budget"] for r in rows if r["kept"] is None and r["method"] != "full"]
    return bool(budgets) and all(isinstance(budget, int) for budget in budgets)


def x_of(point: dict[str, Any], tokens: bool) -> float:
    """Where a point stands on the budget axis: its budget (in percent of a fraction), or a threshold run's share
    (:func:`~h2o_eval.reports.tables.position`), in tokens held where the axis counts tokens."""
    if tokens:
        return point["held"] if point["kept"] is not None else point["budget"]
    return 100 * position(point)


def _title(rows: list[dict[str, Any]], task: str) -> str:
    """The figure's title before the settings its rows share: the task, then the model(s) and the documents (the
    ``limit``, or all of them) its records were run with, since a number means little without them ("copa:
    smollm2-135m, limit=100")."""
    mine = [r for r in rows if r["task"] == task]
    if not mine:
        return task
    limits = sorted({r["limit"] for r in mine}, key=limit_order)
    return f"{task}: {_listed(sorted({r['model'] for r in mine}))}, {_listed([limit_label(x) for x in limits])}"


def _listed(items: list[str]) -> str:
    """``items`` as a phrase: "a", "a and b", "a, b and c"."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _task_rows(
    rows: list[dict[str, Any]], task: str, significant: frozenset[tuple]
) -> tuple[list[dict[str, Any]], str]:
    """The rows of ``task`` as its figure draws them, each marked ``ringed`` when its setting is ``significant``,
    and the one count of questions per context they were all asked ("" when none): that count goes in the title,
    not in every line's label. A (model, limit) pair of a task scored on several limits is drawn as a model of
    its own."""
    rows = [{**r, "ringed": setting_key(r) in significant} for r in rows if r["task"] == task]
    asked = _questions_of_task(rows)
    if asked:
        rows = [{**r, "policy": r["policy_without_questions"]} for r in rows]
    if task in mixed_limits(rows):
        rows = [{**r, "model": f"{r['model']}, {limit_label(r['limit'])}"} for r in rows]
    return rows, asked


def _questions_of_task(rows: list[dict[str, Any]]) -> str:
    """The one count of questions per context that every row of one task was asked, for its figure's title ("" when
    the rows differ in it, so that their labels tell them apart, or when every report row shares it)."""
    counts = {r["questions"] for r in rows}
    if len(counts) != 1 or None in counts or not rows:
        return ""
    return questions_named({rows[0]["task"]: rows[0]["questions"]}, rows[0]["shared"])


def _draw_model(
    ax: Any,
    rows: list[dict[str, Any]],
    drawn: list[tuple],
    index: int,
    models: list[str],
    protocols: list[str],
    tokens: bool,
) -> None:
    """Model ``index`` of ``models``: its full cache as a dashed line in its shade (black, then greys), its
    oracle dotted in the same shade, and its other policies' lines (of ``drawn``: every line of the figure, each
    shifted by its place there) in colours, dash-dotted for every model after the first."""
    import matplotlib.pyplot as plt

    model = models[index]
    method = {r["policy"]: r["method"] for r in rows}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    shade = str(0.45 * index / max(len(models) - 1, 1))
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
        shifted = offset(ax, drawn.index((model, policy, protocol)), len(drawn))
        for quiet in (p for p in points if p["no_eviction"]):  # marked on the axis, never drawn as a score
            ax.annotate("no eviction", (x_of(quiet, tokens), 0.02), xycoords=("data", "axes fraction"), rotation=90,
                        fontsize=7, color=color, va="bottom", ha="center")  # fmt: skip
        _draw_points(
            ax,
            [p for p in points if not p["no_eviction"]],
            shifted,
            tokens,
            label=label,
            color=color,
            linestyle=":" if oracle else "-" if index == 0 else "-.",
            markersize=4 if oracle else 6,
        )


def _draw_points(ax: Any, points: list[dict[str, Any]], transform: Any, tokens: bool, **style: Any) -> None:
    """One line of a figure in ``style`` (its label, color, linestyle and markersize): its points with their
    stderr as error bars, drawn through the sideways-shifted ``transform`` at :func:`x_of` (``tokens``: on an axis
    of tokens), the ``ringed`` ones circled."""
    ax.errorbar(
        [x_of(p, tokens) for p in points],
        [p["value"] for p in points],
        yerr=[p["stderr"] or 0.0 for p in points],
        marker="o",
        capsize=3,
        transform=transform,
        **style,
    )
    ax.update_datalim(  # an offset transform keeps the points out of autoscaling
        [(x_of(p, tokens), p["value"] + sign * (p["stderr"] or 0.0)) for p in points for sign in (-1, 1)]
    )
    ringed = [p for p in points if p["ringed"]]
    ax.scatter(
        [x_of(p, tokens) for p in ringed],
        [p["value"] for p in ringed],
        s=160,
        facecolors="none",
        edgecolors=style["color"],
        label="_ringed",
    ).set_offset_transform(transform)


def write_figures(rows: list[dict[str, Any]], out: Path, significant: frozenset[tuple] = frozenset()) -> list[Path]:
    """:func:`figure` of each task of ``rows`` as ``out``/<task>.png and .pdf, the ``significant`` settings
    ringed; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for task in sorted({r["task"] for r in rows}):
        written += save(figure(rows, task, significant), out / task, dpi=150)
    return written
