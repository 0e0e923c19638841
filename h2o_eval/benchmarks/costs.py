"""What a run costs on this machine: seconds per document (or question) for each task family and length, per model,
one thread, and the generation's tokens/s; docs/costs.md's "Seconds per document" table is this script's output.

    python -m h2o_eval.benchmarks.costs --data-dir ../shared/data [--models smollm2-135m gemma3-270m]
    python -m h2o_eval.benchmarks.costs --leaderboard SHARED ONE [--model smollm2-135m] [--documents 40]
    python -m h2o_eval.benchmarks.costs --parts RECORDS
    python -m h2o_eval.benchmarks.costs --estimate MEASURED ANSWERS... [--model smollm2-135m] [--documents 40]
    python -m h2o_eval.benchmarks.costs --reasoning --data-dir ../shared/data [--models smollm2-135m] [--batches 1 10]

``--reasoning`` runs MATH-500's first problems (as many as the largest batch) under H2O at 256 tokens (256 new
tokens at most) once per batch size, the problems leaving their batch as their solutions end, and prints the
solutions' generated tokens per CPU second and per second of wall time (the policy's own generation: not the full
cache's solutions the agreement needs, nor the load).

``--parts`` reads the records in RECORDS that split their CPU time (``generation.cpu_seconds``) and prints, per task
and model, the CPU seconds per context and cell of each part: the prompt's pass, scoring, the question's pass,
decoding, the rest of the evaluation (data, scoring the answers) and the model's load (once per run of cells).
``--estimate`` takes those parts from MEASURED (a run of the preset's cells on one task) and each task's answer
length from the records in ANSWERS (:func:`parts_estimate`).

Each setting is one ``python -m h2o_eval`` run (the real runner, record and all) on a few documents, in a
temporary results folder; the model's load (and a GGUF's one-time conversion) is not counted (``load_seconds``).

``--leaderboard`` estimates, from records, what ``+experiment=kv_leaderboard`` (kvpress's protocol: one question per
context) costs on all of RULER's thirteen tasks. It reads the records of the preset's cells alone (its policies at
its budgets, and the full cache), each at its task's mean CPU time (wall time in records older than their CPU time):
a cell of a task costs ``D * c + Q * q`` for D contexts
and Q questions. A task with records of both protocols (``SHARED``: several questions per context, ``ONE``: one)
gives its own context cost c and question cost q; a task with shared records only takes the mean c of those and its
own q; a task that asks one question per context in both is its own measure. Each task then counts the preset's
cells, those its records lack at the mean cost of those they hold.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

# (label, overrides, unit): the task families at the lengths the docs' examples use.
SETTINGS = [
    ("copa 0-shot, simulate, h2o 20 %", ["task=copa", "limit=20"], "document"),
    ("piqa 5-shot, simulate, h2o 20 %", ["task=piqa", "num_fewshot=5", "limit=10"], "document"),
    ("xsum 1-shot, prefill, h2o 20 %", ["task=xsum", "num_fewshot=1", "limit=4", "batch_size=4"], "document"),
    *(
        (
            f"niah_single_2 {length // 1024}k, context, h2o 25 %",
            [
                "task=niah_single_2",
                f"task.length={length}",
                "limit=4",
                "batch_size=4",
                "protocol=context",
                "budget=0.25",
            ],
            "question",
        )  # fmt: skip
        for length in (1024, 2048, 4096)
    ),
    (
        "niah_single_2 4k, 4 questions per context",
        [
            "task=niah_single_2",
            "task.length=4096",
            "task.questions=4",
            "limit=2",
            "batch_size=2",
            "protocol=context",
            "budget=0.25",
        ],
        "question",
    ),  # fmt: skip
]


def measure(model: str, overrides: list[str], data_dir: Path, results: Path) -> dict:
    from h2o_eval.grid import compose
    from h2o_eval.run import run

    config = compose([f"model={model}", *overrides, f"data_dir={data_dir}", f"results_dir={results}", "threads=1"]
                     + ["wandb.mode=disabled", "overwrite=true"])  # fmt: skip
    return run(config)


def task_costs(folder: Path, model: str, cells: set[tuple[str, float]]) -> dict[str, tuple[float, int, int]]:
    """Per long-context task of ``model`` in ``folder``: the mean ``cpu_seconds`` (else ``wall_seconds``) of its
    records of the ``cells``
    (:func:`cell`), and the contexts and questions a cell answered (each cell of a task answers the same ones)."""
    from h2o_eval.results import load_records

    found: dict[str, list[tuple[float, int, int]]] = {}
    for record in load_records(folder):
        if record["model"] != model or "n_documents" not in record:
            continue
        if cell(record["policy_params"], record["budget"]) not in cells:
            continue
        found.setdefault(record["task"], []).append(
            (record.get("cpu_seconds", record["wall_seconds"]), record["n_documents"], record["n_questions"])
        )
    return {task: (sum(s for s, _, _ in held) / len(held), *held[0][1:]) for task, held in found.items()}


def cell(params: dict[str, Any], budget: float | int) -> tuple[str, float | int]:
    """A leaderboard cell: a policy's parameters (:meth:`~h2o_eval.policies.Policy.describe`, a record's
    ``policy_params``) but its budget and rounding, and the budget."""

    def kept(found: dict[str, Any]) -> dict[str, Any]:
        return {k: kept(v) if isinstance(v, dict) else v for k, v in found.items() if k not in ("budget", "rounding")}

    return json.dumps(kept(params), sort_keys=True), budget


def described(option: str) -> dict[str, Any]:
    """The parameters (:meth:`~h2o_eval.policies.Policy.describe`) of the policy a ``policy=`` option builds, as
    the CLI composes it (``kvpress/snapkv``: snapkv with kvpress's window, kernel and pooling)."""
    from omegaconf import OmegaConf

    from h2o_eval.names import compose
    from h2o_eval.policies import configured_policy

    return configured_policy(OmegaConf.to_container(compose([f"policy={option}"]), resolve=True)).describe()


def preset_cells(preset: str = "kv_leaderboard") -> tuple[list[str], list[float], set[tuple[str, float | int]]]:
    """The policies and budgets a leaderboard preset sweeps, and its :func:`cell` s: the full cache is one cell at
    every ratio (one record at budget 1.0), every other policy one per budget."""
    from h2o_eval.conf import options

    params = options("experiment")[preset]["hydra"]["sweeper"]["params"]
    policies, budgets = str(params["policy"]).split(","), [float(b) for b in str(params["budget"]).split(",")]
    cells = set()
    for policy in policies:
        made = described(policy)
        cells |= {cell(made, 1.0)} if policy == "full" else {cell(made, budget) for budget in budgets}
    return policies, budgets, cells


def leaderboard_estimate(
    shared: Path, one: Path, model: str, documents: int, cells: set[tuple[str, float]]
) -> list[tuple[str, str, float]]:
    """Per RULER task, how its one-question cost was found and the seconds one of its ``cells`` would take on
    ``documents`` contexts of one question each (see the module)."""
    from h2o_eval.reports.headline import RULER_TASKS

    many, single = task_costs(shared, model, cells), task_costs(one, model, cells)
    split = {}  # task -> (c, q) from both protocols: D4 c + Q4 q = T4 and D1 c + Q1 q = T1
    for task in many.keys() & single.keys():
        (t4, d4, q4), (t1, d1, q1) = many[task], single[task]
        if q4 > d4 and q1 == d1:
            context = (t1 * q4 - t4 * q1) / (d1 * q4 - d4 * q1)
            split[task] = (context, (t1 - d1 * context) / q1)
    if not split:
        raise SystemExit("error: no task has records of both protocols: run one in ONE (+experiment=kv_leaderboard)")
    context = sum(c for c, _ in split.values()) / len(split)
    rows = []
    for task in RULER_TASKS:
        if task in split:
            rows.append((task, "both protocols", documents * sum(split[task])))
        elif task in single or (task in many and many[task][1] == many[task][2]):
            seconds, contexts, _ = single.get(task) or many[task]
            rows.append((task, "one question per context", seconds / contexts * documents))
        elif task in many:
            seconds, contexts, questions = many[task]
            rows.append(
                (
                    task,
                    "shared records, mean context cost",
                    documents * (seconds - contexts * context) / questions + documents * context,
                )
            )
        else:
            rows.append((task, "no records", float("nan")))
    return rows


def parts(folder: Path) -> list[tuple[str, str, int, dict[str, float]]]:
    """Per (task, model) of the records in ``folder`` that split their CPU time: the cells, and the mean CPU seconds
    per context and cell of each part (``load``: the model's load, once per run of cells, per context and cell)."""
    from h2o_eval.generation.log import PARTS
    from h2o_eval.results import load_records

    found: dict[tuple[str, str], list[dict]] = {}
    for record in load_records(folder):
        if "cpu_seconds" in record.get("generation", {}):
            found.setdefault((record["task"], record["model"]), []).append(record)
    rows = []
    for (task, model), records in sorted(found.items()):
        each = {part: 0.0 for part in (*PARTS, "rest", "load")}
        for record in records:
            contexts, split = record["n_documents"], record["generation"]["cpu_seconds"]
            for part in PARTS:
                each[part] += split[part] / contexts
            each["rest"] += (record["cpu_seconds"] - sum(split.values())) / contexts
            cells = record["generation"].get("shared_prompt_cells", 1)
            each["load"] += record["load_cpu_seconds"] / cells / contexts
        rows.append((task, model, len(records), {part: seconds / len(records) for part, seconds in each.items()}))
    return rows


def parts_estimate(measured: Path, answers: list[Path], model: str, documents: int) -> list[tuple[str, float, float]]:
    """Per RULER task, the CPU seconds of ``+experiment=kv_leaderboard`` on ``documents`` contexts, from the parts
    of a run of the preset's cells (``measured``: one task's records, each with ``generation.cpu_seconds``) at the
    task's answer length in ``answers`` (records of ``model``: the mean of their ``generated_tokens_mean``). Per
    context: the cells' prompt, scoring and question parts as measured, and their decoding per generated token
    times the task's answer length, for every cell. Returns (task, answer length, seconds)."""
    from h2o_eval.reports.headline import RULER_TASKS
    from h2o_eval.results import load_records

    records = [r for r in load_records(measured) if "cpu_seconds" in r.get("generation", {})]
    if not records:
        raise SystemExit(f"error: no record in {measured} splits its CPU time: run the preset there first")
    contexts = records[0]["n_documents"]
    fixed = sum(sum(r["generation"]["cpu_seconds"][p] for p in ("prompt", "scoring", "question")) for r in records)
    tokens = sum(r["generation"]["generated_tokens_mean"] * r["n_questions"] for r in records)
    per_token = sum(r["generation"]["cpu_seconds"]["decoding"] for r in records) / max(tokens, 1)
    lengths: dict[str, list[float]] = {}
    for folder in answers:
        for record in load_records(folder):
            if record["model"] == model and "generation" in record and record["task"] in RULER_TASKS:
                lengths.setdefault(record["task"], []).append(record["generation"]["generated_tokens_mean"])
    measured_length = tokens / (len(records) * contexts)
    rows = []
    for task in RULER_TASKS:
        length = sum(lengths[task]) / len(lengths[task]) if task in lengths else measured_length
        rows.append((task, length, documents * (fixed / contexts + per_token * length * len(records))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--leaderboard", nargs=2, type=Path, metavar=("SHARED", "ONE"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--parts", type=Path, metavar="RECORDS")
    parser.add_argument("--estimate", type=Path, nargs="+", metavar=("MEASURED", "ANSWERS"))
    parser.add_argument("--reasoning", action="store_true", help="tokens/s of reasoning solutions, per batch size")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 10], help="the reasoning board's batch: 10")
    args = parser.parse_args()
    if args.reasoning:
        if args.data_dir is None:
            parser.error("--reasoning reads MATH-500: give --data-dir")
        print("| model | batch | solutions | generated tokens | generation CPU s | tokens per CPU s | tokens/s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        overrides = ["task=math500", f"limit={max(args.batches)}", "policy=h2o", "budget=256"]
        overrides += ["task.max_new_tokens=256"]
        with tempfile.TemporaryDirectory() as folder:
            for model in args.models:
                for batch in args.batches:
                    record = measure(model, [*overrides, f"batch_size={batch}"], args.data_dir.resolve(), Path(folder))
                    generation = record["generation"]
                    tokens = generation["generated_tokens_mean"] * record["n_samples"]
                    cpu = sum(generation["cpu_seconds"].values())
                    n, speed = record["n_samples"], generation["generated_tokens_per_s"]
                    print(f"| {model} | {batch} | {n} | {tokens:.0f} | {cpu:.1f} | {tokens / cpu:.1f} | {speed:.1f} |")
        return
    if args.estimate:
        rows = parts_estimate(args.estimate[0], args.estimate[1:], args.model, args.documents)
        print(f"kv_leaderboard from the parts in {args.estimate[0]}, {args.documents} contexts a task")
        print("| task | answer tokens | estimated CPU hours |")
        print("|---|---:|---:|")
        for task, length, seconds in rows:
            print(f"| {task} | {length:.1f} | {seconds / 3600:.2f} |")
        print(f"| all {len(rows)} | | {sum(seconds for *_, seconds in rows) / 3600:.1f} |")
        return
    if args.parts:
        print("CPU seconds per context and cell, by part")
        print("| task | model | cells | prompt | scoring | question | decoding | rest | load | total |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for task, model, cells, each in parts(args.parts):
            numbers = " | ".join(f"{each[part]:.2f}" for part in each)
            print(f"| {task} | {model} | {cells} | {numbers} | {sum(each.values()):.2f} |")
        return
    if args.leaderboard:
        policies, budgets, cells = preset_cells()
        rows = leaderboard_estimate(*args.leaderboard, args.model, args.documents, cells)
        print(f"kv_leaderboard: {len(policies)} policies x {len(budgets)} ratios, {len(cells)} cells per task, "
              f"{args.documents} contexts each")  # fmt: skip
        print("| task | measured from | CPU seconds per cell | estimated CPU hours |")
        print("|---|---|---:|---:|")
        for task, source, seconds in rows:
            print(f"| {task} | {source} | {seconds:.0f} | {seconds * len(cells) / 3600:.1f} |")
        total = sum(seconds for *_, seconds in rows if not math.isnan(seconds)) * len(cells) / 3600
        print(f"| all {len(rows)} | | | {total:.1f} |")
        return
    if args.data_dir is None:
        parser.error("give --data-dir (the settings' runs) or --leaderboard SHARED ONE (an estimate from records)")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for model in args.models:
            for label, overrides, unit in SETTINGS:
                record = measure(model, overrides, args.data_dir.resolve(), Path(folder))
                per = record["wall_seconds"] / record["n_samples"]
                speed = record.get("generation", {}).get("generated_tokens_per_s")
                rows.append((model, label, record["n_samples"], unit, per, speed, record["load_seconds"]))
                print(f"{model} | {label} | {per:.1f} s per {unit}", file=sys.stderr, flush=True)
    print("| model | setting | n | seconds per document (question) | generated tokens/s | model load s |")
    print("|---|---|---:|---:|---:|---:|")
    for model, label, n, unit, per, speed, load in rows:
        tokens = "–" if speed is None else f"{speed:.1f}"
        print(f"| {model} | {label} | {n} | {per:.1f} per {unit} | {tokens} | {load:.0f} |")


if __name__ == "__main__":
    main()
