"""A conversation's scores turn by turn (``protocol=turns`` records; ``python -m h2o_eval.plot DIR --by turn``).

Each record scores every question at its turn as well (``<metric>_turn<k>``, the long-context runner's
:func:`~h2o_eval.runners.long_context.turn_scores`). Per model, prompt length, history, schedule, policy and budget,
``turns.md`` gives the mean over tasks at each turn (x100, with the interval that resamples documents within each
task) and the last turn less the first; then, per budget, whether the schedule or the history changes the
ranking of the policies that ran under every one (Kendall's tau over their mean on the turns after the first).
``turns.pdf`` draws them, a panel per history, schedule and budget, the full cache and the oracle (under
``once``, which compresses the context alone) as dashed lines. ``paired_turns.md`` compares each setting with the
full cache of its history at each turn, question by question (:mod:`~h2o_eval.reports.paired`): its mean over the
tasks where it ran on several, else each task's."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

from h2o_eval import settings, stats
from h2o_eval.reports.tables import percent

LINES = ("full", "oracle")  # drawn dashed in every panel of their history


def policy_labels(records: list[dict[str, Any]]) -> dict[str, str]:
    """Each built policy's label (by its parameters as JSON): its name, and its parameters that depart from its YAML's
    only where the records hold two settings of that name (budgets aside)."""
    built = {json.dumps(r["policy_params"], sort_keys=True): r for r in records}
    departing = {key: settings.policy_departures(record["policy_params"]) for key, record in built.items()}
    kinds: dict[str, set[str]] = {}
    for key, parameters in departing.items():
        kinds.setdefault(built[key]["policy"], set()).add(json.dumps(parameters, sort_keys=True))
    return {
        key: " ".join([name, *(settings.label(k, v) for k, v in departing[key].items())])
        if len(kinds[built[key]["policy"]]) > 1
        else name
        for key in built
        for name in [_name(built[key])]
    }


def _name(record: dict[str, Any]) -> str:
    """A policy's name, a wrapper's with its base's: ``adakv(expected_attention)``."""
    base = record["policy_params"].get("base")
    return record["policy"] + (f"({base['name']})" if isinstance(base, dict) else "")


def question_scores_by_turn(records: list[dict[str, Any]], results_dir: Path) -> dict[tuple, dict[int, dict]]:
    """Per setting (model, length, history, schedule, policy with its parameters, budget), turn and task, its
    per-question scores at that turn (:func:`~h2o_eval.stats.question_scores`, each task on its own metric). The
    newest record of a task and setting counts."""
    scores: dict[tuple, dict[int, dict[str, dict]]] = {}
    labels = policy_labels(records)
    for record in sorted(records, key=lambda r: r["created"]):
        if record["protocol"] != "turns":
            continue
        metric, turns = stats.primary_metric(record), record["config"]["turns"]
        policy = labels[json.dumps(record["policy_params"], sort_keys=True)]
        key = (record["model"], record["length"], turns["history"], turns["schedule"], policy, record["budget"])
        for name in record["metrics"]:
            if found := re.fullmatch(rf"{metric}_turn(\d+)", name):
                asked = stats.question_scores(record, results_dir, name)
                scores.setdefault(key, {}).setdefault(int(found.group(1)), {})[record["task"]] = asked
    return scores


def by_turn(scores: dict[tuple, dict[int, dict]]) -> dict[tuple, dict[int, stats.Estimate]]:
    """Per setting the mean over tasks at each turn, x100, of :func:`question_scores_by_turn`'s ``scores``."""

    def estimate(tasks: dict[str, dict]) -> stats.Estimate:
        return stats.mean_over_tasks(
            [
                ([100 * value for _, value in asked.values()], [doc for doc, _ in asked.values()])
                for asked in tasks.values()
            ]
        )

    return {
        key: {k: estimate(tasks) for k, tasks in sorted(turns.items())}
        for key, turns in scores.items()
        if all(tasks and all(tasks.values()) for tasks in turns.values())
    }


def turns_markdown(found: dict[tuple, dict[int, stats.Estimate]]) -> str:
    """``turns.md``: a table per model and length, then the rankings (see the module)."""
    parts = []
    for (model, length), group in _by(found, lambda key: key[:2]).items():
        count = max(max(turns) for turns in group.values())
        header = ["history", "schedule", "policy", "ratio"] + [f"turn {k}" for k in range(1, count + 1)]
        lines = [
            "Each turn (x100, mean over tasks, 95 % interval resampling documents within each task):",
            "",
            _row(header + ["last - first"]),
            _row(["---"] * 4 + ["---:"] * (count + 1)),
        ]
        for key in sorted(group, key=_order):
            turns = group[key]
            cells = [
                f"{turns[k].value:.1f} [{turns[k].low:.1f}, {turns[k].high:.1f}]" if k in turns else ""
                for k in range(1, count + 1)
            ]
            change = turns[max(turns)].value - turns[min(turns)].value
            lines.append(_row([key[2], key[3], key[4], _ratio(key[5]), *cells, f"{change:+.1f}"]))
        parts += [f"## {model}, {length} tokens", "", _summary(group), "", _rankings(group), "", "\n".join(lines), ""]
    return "\n".join(parts)


def _summary(group: dict[tuple, dict[int, stats.Estimate]]) -> str:
    """The first turn, and the mean of the turns after it, per policy and ratio (rows) under each history and
    schedule (columns)."""
    conditions = sorted({key[2:4] for key in group}, key=lambda c: (c[0], c[1] == "once", c[1]))
    rows = sorted({key[4:6] for key in group}, key=lambda r: (r[0] not in LINES, r[0], -r[1]))
    lines = [
        "Turn 1, and the mean of turns 2 and later (x100), per history/schedule:",
        "",
        _row(["policy", "ratio", *(f"{h}/{s}" for h, s in conditions)]),
        _row(["---", "---", *["---:"] * len(conditions)]),
    ]
    for policy, budget in rows:
        cells = []
        for history, schedule in conditions:
            turns = group.get((*next(iter(group))[:2], history, schedule, policy, budget))
            later = [t.value for k, t in (turns or {}).items() if k > 1]
            cells.append(f"{turns[1].value:.1f}, {sum(later) / len(later):.1f}" if turns and later else "")
        lines.append(_row([policy, _ratio(budget), *cells]))
    return "\n".join(lines)


def _rankings(group: dict[tuple, dict[int, stats.Estimate]]) -> str:
    """Per budget, Kendall's tau between the rankings of the policies that ran under every history and schedule
    (their mean on the turns after the first): for each history, nested against new_turn; for each schedule, gold
    against own."""
    lines = ["Rankings (Kendall's tau over the policies' mean on turns 2 and later; 1: the same order):", ""]
    for budget in sorted({key[5] for key in group if key[4] not in LINES}, reverse=True):
        means = {
            key[2:5]: sum(t.value for k, t in turns.items() if k > 1) / max(len(turns) - 1, 1)
            for key, turns in group.items()
            if key[5] == budget and key[4] not in LINES and key[3] != "once"
        }
        conditions = sorted({(h, s) for h, s, _ in means})
        policies = sorted({p for *_, p in means if all((*c, p) in means for c in conditions)})
        if len(policies) < 2:
            continue
        said = []
        for a, b in itertools.combinations(conditions, 2):
            if a[0] == b[0] or a[1] == b[1]:
                tau = _kendall([means[(*a, p)] for p in policies], [means[(*b, p)] for p in policies])
                said.append(f"{'/'.join(a)} vs {'/'.join(b)}: {tau:+.2f}")
        lines.append(f"- ratio {_ratio(budget)}, {len(policies)} policies: " + "; ".join(said))
    return "\n".join(lines)


def _kendall(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two lists of scores."""
    concordant = discordant = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        x, y = (a[i] > a[j]) - (a[i] < a[j]), (b[i] > b[j]) - (b[i] < b[j])
        ties_a, ties_b = ties_a + (x == 0 and y != 0), ties_b + (y == 0 and x != 0)
        concordant, discordant = concordant + (x * y > 0), discordant + (x * y < 0)
    denominator = ((concordant + discordant + ties_a) * (concordant + discordant + ties_b)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def turns_figure(found: dict[tuple, dict[int, stats.Estimate]], model: str, length: int) -> Any:
    """The scores against the turn for one model and length: a panel per history (rows) and schedule and budget
    (columns), a line per policy; dashed, the full cache (of the panel's history and schedule, else of ``once``) and
    the oracle (of the panel's history and budget)."""
    import matplotlib.pyplot as plt

    group = {key[2:]: turns for key, turns in found.items() if key[:2] == (model, length)}
    histories = sorted({history for history, *_ in group})
    columns = sorted({(s, b) for _, s, p, b in group if p not in LINES}, key=lambda c: (c[0] == "once", c[0], -c[1]))
    width = max(len(columns), 1)
    figure, axes = plt.subplots(
        len(histories), width, figsize=(3.2 * width, 2.8 * len(histories)), squeeze=False, sharey=True
    )
    policies = sorted({p for _, _, p, _ in group if p not in LINES})
    colours = {p: plt.cm.tab20(i % 20) for i, p in enumerate(policies)}
    for (r, history), (c, (schedule, budget)) in itertools.product(enumerate(histories), enumerate(columns)):
        ax = axes[r][c]
        full = (
            (history, schedule, "full", 1.0)
            if (history, schedule, "full", 1.0) in group
            else (history, "once", "full", 1.0)
        )
        drawn = [key for key in group if key[0] == history and key[2] not in LINES and key[1:4:2] == (schedule, budget)]
        for key in [full, (history, "once", "oracle", budget), *sorted(drawn)]:
            if key not in group:
                continue
            line = key[2] in LINES
            style = {"linestyle": "--", "color": "black" if key[2] == "full" else "grey"} if line else {}
            turns = group[key]
            ax.plot(
                list(turns), [t.value for t in turns.values()], marker="o", markersize=3,
                label=key[2] + (" (once)" if key[2] == "oracle" else ""), color=style.pop("color", colours.get(key[2])),
                **style,
            )  # fmt: skip
        ax.set_title(f"{history}, {schedule}, ratio {_ratio(budget)}", fontsize=8)
        ax.set_xlabel("turn")
        ax.set_xticks(sorted({k for turns in group.values() for k in turns}))
        if c == 0:
            ax.set_ylabel("score x100 (mean over tasks)")
    handles = {label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    figure.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    figure.suptitle(f"{model}, {length} tokens: the score at each turn of the conversation", fontsize=9)
    figure.tight_layout()
    return figure


def paired_markdown_by_turn(scores: dict[tuple, dict[int, dict]], against: str = "full") -> str:
    """``paired_turns.md``: at each turn, each setting against ``against`` of the same model, length, history and
    schedule (of ``once`` where its schedule has none), question by question: the mean over their tasks of the
    difference (x100), its document-bootstrap interval, and the sign-flip test's p (:func:`~h2o_eval.stats.paired_mean`;
    each task on its own metric; ``scores``: :func:`question_scores_by_turn`'s)."""
    lines = []
    for key in sorted(scores, key=_order):
        model, length, history, schedule, policy, budget = key
        if policy == against:
            continue
        base = scores.get((model, length, history, schedule, against, 1.0)) or scores.get(
            (model, length, history, "once", against, 1.0)
        )
        for k, tasks in sorted(scores[key].items()):
            pairs = [stats.align(own, base[k][task]) for task, own in tasks.items() if base and task in base.get(k, {})]
            if not pairs or any(pair is None for pair in pairs):
                continue
            found = stats.paired_mean(pairs)
            verdict = " *" if found.significant else ""
            lines.append(
                _row([str(k), history, schedule, policy, _ratio(budget), str(len(pairs)), str(found.n),
                      f"{100 * found.difference:+.1f} [{100 * found.low:+.1f}, {100 * found.high:+.1f}]",
                      f"{found.test.p:.2g}{verdict}"])
            )  # fmt: skip
    if not lines:
        return ""
    header = ["turn", "history", "schedule", "policy", "ratio", "tasks", "questions", f"policy - {against} x100", "p"]
    intro = (
        f"Paired against {against} of the same history and schedule, question by question, at each turn: the mean over "
        "tasks of the difference with its 95 % document-bootstrap interval, and the sign-flip permutation test's p "
        f"(documents' questions flipped together; * p < {stats.ALPHA}), as `paired_full.md` elsewhere."
    )
    return (
        "\n".join(
            [intro, "", _row(header), _row(["---:", "---", "---", "---", "---", "---:", "---:", "---", "---:"]), *lines]
        )
        + "\n"
    )


def write_by_turn(
    records: list[dict[str, Any]], results_dir: Path, out: Path, against: str = "full"
) -> tuple[list[Path], str]:
    """``plot --by turn``: ``turns.md``, ``turns.pdf`` per model and length, and ``paired_turns.md`` (see the
    module). ValueError when no record is of ``protocol=turns``."""
    import matplotlib.pyplot as plt

    scores = question_scores_by_turn(records, results_dir)
    if not scores:
        raise ValueError("no protocol=turns record with per-turn scores: run +experiment=kv_multiturn first")
    found = by_turn(scores)
    out.mkdir(parents=True, exist_ok=True)
    text = turns_markdown(found)
    files = [out / "turns.md"]
    files[0].write_text(text)
    for model, length in sorted({key[:2] for key in found}):
        figure = turns_figure(found, model, length)
        path = out / (f"turns_{model}_{length}.pdf" if len({key[:2] for key in found}) > 1 else "turns.pdf")
        figure.savefig(path, bbox_inches="tight")
        plt.close(figure)
        files.append(path)
    paired = paired_markdown_by_turn(scores, against)
    if paired:
        files.append(out / "paired_turns.md")
        files[-1].write_text(paired)
    return files, text


def _by(found: dict, key) -> dict:
    grouped: dict = {}
    for k, v in found.items():
        grouped.setdefault(key(k), {})[k] = v
    return grouped


def _order(key: tuple) -> tuple:
    """History, schedule (once last), the full cache and the oracle first, then policy, larger budget first."""
    return (
        key[2],
        key[3] == "once",
        key[3],
        key[4] not in LINES,
        LINES.index(key[4]) if key[4] in LINES else 0,
        key[4],
        -key[5],
    )


def _ratio(budget: float) -> str:
    """kvpress's compression ratio of a fraction budget (the share that goes)."""
    return f"{1 - budget:g}" if isinstance(budget, float) else percent(budget)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
