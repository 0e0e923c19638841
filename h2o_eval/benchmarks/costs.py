"""What a run costs on this machine: seconds per document (or question) for each task family and length, per model,
one thread, and the generation's tokens/s; docs/costs.md's "Seconds per document" table is this script's output.

    python -m h2o_eval.benchmarks.costs --data-dir ../shared/data [--models smollm2-135m gemma3-270m]

Each setting is one ``python -m h2o_eval`` run (the real runner, record and all) on a few documents, in a
temporary results folder; the model's load (and a GGUF's one-time conversion) is not counted (``load_seconds``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    args = parser.parse_args()
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
