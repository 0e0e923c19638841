"""Where a report's records came from (``PROVENANCE.md``), read from the records themselves: per commit how many,
whether its tree was dirty, when, the machine time, threads and library versions, what ran; and the settings they
share or vary in, so that no README has to carry that by hand."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from h2o_eval.reports.headline import task_order
from h2o_eval.settings import report_labels

PROVENANCE = "PROVENANCE.md"
PROVENANCE_VERSIONS = ("torch", "transformers", "lm_eval")
# The settings every report names in its own columns, in the order the provenance lists them.
PROVENANCE_NAMED = ("model", "task", "length", "policy", "budget", "protocol", "num_fewshot", "limit", "data")
# How a run was run: never part of its identity (results.NOT_IDENTITY), so never a reason its numbers differ.
PROVENANCE_HOW = ("batch_size", "stack_cells", "device", "kernels", "graphs")


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


def _commit(git: dict[str, Any] | None) -> str:
    """A record's (or a stopped run's) ``git`` as its commit's first 7 hex digits ("unknown" without one)."""
    commit = (git or {}).get("commit")
    return commit[:7] if commit else "unknown"


def _cpu(records: list[dict[str, Any]]) -> str:
    """The records' summed ``cpu_seconds``, and how many hold none (they predate it)."""
    held = [r["cpu_seconds"] for r in records if r.get("cpu_seconds") is not None]
    missing = len(records) - len(held)
    return _duration(sum(held)) + (f" ({missing} without)" if missing else "") if held else "–"


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
        _cpu(records),
        _duration(sum(r.get("load_seconds") or 0.0 for r in records)),
        _duration(_span(records)),
        _counted([(r.get("threads") or {}).get("torch") for r in records]),
        *versions,
        ", ".join(sorted({r["model"] for r in records})),
    ]
    return "| " + " | ".join(cells) + " |"


def provenance(records: list[dict[str, Any]], source: str, chosen: str = "") -> str:
    """Where ``records`` (read from ``source``, those of the ``--task``/``--model`` options in ``chosen``) came
    from, as Markdown: per commit (the oldest first) how many records it computed, how many of them with a dirty
    tree, the first and last ``created``, the summed ``wall_seconds``, ``cpu_seconds`` and ``load_seconds`` and the
    elapsed span, the torch threads, the versions of torch, transformers and lm_eval and the models; then what each
    commit computed; the runs that took up a stopped run's answers; then the settings every record shares and those
    that vary, with their counts. Everything is read from the records, so regenerating it from the same records
    writes the same file."""
    if not records:
        raise ValueError(f"no records in {source}: nothing to tell the provenance of")
    by_commit: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_commit.setdefault(_commit(record.get("git")), []).append(record)
    commits = sorted(by_commit, key=lambda c: (min(_utc(r["created"]) for r in by_commit[c]), c))
    dirty = sum((r.get("git") or {}).get("dirty") is True for r in records)
    first, last = min(_utc(r["created"]) for r in records), max(_utc(r["created"]) for r in records)
    lines = [
        f"# Provenance of `{source}`",
        "",
        f"Generated from the records by `python -m h2o_eval.plot {source}{chosen} --provenance`: every entry is "
        "read from "
        "the records (`git`, `created`, `wall_seconds`, `cpu_seconds`, `load_seconds`, `threads`, `versions`, "
        "`config`). "
        "Regenerate it; never edit it.",
        "",
        f"{len(records)} records, computed at {len(commits)} commit{'s' if len(commits) != 1 else ''} ({dirty} of "
        f"them with a dirty tree: uncommitted changes), from {first:%Y-%m-%d %H:%M} to {last:%Y-%m-%d %H:%M} UTC.",
        "",
        "## Commits",
        "",
        "Times are UTC. Run time is the records' summed `wall_seconds` (a grid's cells share their run time); "
        "CPU time their summed `cpu_seconds` (the process's CPU time, shared alike; records older than it hold "
        "none); load is the summed `load_seconds` (a grid's cells share one model load, counted once per cell); "
        "elapsed runs from the first record's start to the last one's end, overlapping runs counted once. Threads: "
        "torch's intra-op threads per process.",
        "",
        "| commit | records | dirty | first created | last created | run time | CPU time | load | elapsed | threads "
        "| " + " | ".join(PROVENANCE_VERSIONS) + " | models |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---|---|---|---|---|",
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
    lines += [*_resumed_lines(records), "", "## Settings", "", *_settings_lines(records)]
    return "\n".join(lines) + "\n"


def _resumed_lines(records: list[dict[str, Any]]) -> list[str]:
    """The records whose run took up the answers a stopped run had left (``generation.resumed``): per commit that
    finished them and commit the stopped run began at (its tree dirty or not), how many records and how many answers
    each took up; nothing where no record was resumed."""
    runs: Counter = Counter()
    for record in records:
        earlier = (record.get("generation") or {}).get("resumed")
        if not earlier:
            continue
        dirty = " (dirty)" if (earlier.get("git") or {}).get("dirty") else ""
        runs[(_commit(record.get("git")), _commit(earlier.get("git")) + dirty, earlier.get("answers"))] += 1
    if not runs:
        return []
    return [
        "",
        "## Resumed runs",
        "",
        "Records whose run took up the answers a stopped run had left: the answers it kept were computed at the "
        "commit that run began at, the rest at the record's own.",
        "",
        "| commit | begun at | records | answers taken up per record |",
        "|---|---|---:|---:|",
        *(
            f"| {finished} | {began} | {n} | {answers} |"
            for (finished, began, answers), n in sorted(runs.items(), key=str)
        ),
    ]


def _settings_lines(records: list[dict[str, Any]]) -> list[str]:
    """The settings every record shares and those that vary (each value with its record count): those the
    reports name in columns, the departures from the defaults (:func:`h2o_eval.settings.report_labels`), then
    how the runs were run, which never changes a number (batch size, stacked cells, device, kernels, graphs)."""
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
