"""What stacking the cells saves: one unit of the leaderboard (a task and a group of policies at kvpress's four
ratios, 4 questions per haystack) run by ``python -m h2o_eval.grid`` with ``stack_cells=false`` (each cell answers
alone) and ``stack_cells=true`` (the cells answer each question in one batch), on the same haystacks, one thread.
Prints each one's seconds (model load included) and answers per CPU-hour, and how many answers differ: the two are
equal up to float rounding.

    python -m h2o_eval.benchmarks.stacked_cells --data-dir ../shared/data --model gemma3-270m \\
        [--task niah_single_2] [--policies expected_attention,keydiff,h2o] [--haystacks 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def answers(folder: Path) -> dict[tuple, str]:
    """Every answer in a results folder: (policy, budget, question id) -> prediction."""
    found = {}
    for path in folder.glob("*.json"):
        record = json.loads(path.read_text())
        for line in (folder / record["outputs"]).read_text().splitlines():
            row = json.loads(line)
            found[(record["policy"], record["budget"], row["id"])] = row["prediction"]
    return found


def main() -> None:
    from h2o_eval import grid

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--policies", default="expected_attention,keydiff,h2o")
    parser.add_argument("--haystacks", type=int, default=1)
    args = parser.parse_args()
    rows, found = [], {}
    with tempfile.TemporaryDirectory() as folder:
        for stack in (False, True):
            out = Path(folder) / f"stack_{stack}"
            began = time.perf_counter()
            grid.main([
                "+experiment=kv_leaderboard_shared", f"model={args.model}", f"task={args.task}",
                f"limit={args.haystacks}", "batch_size=1", f"policy={args.policies}",
                f"stack_cells={str(stack).lower()}", f"data_dir={args.data_dir.resolve()}", f"results_dir={out}",
                "threads=1", "wandb.mode=disabled",
            ])  # fmt: skip
            seconds = time.perf_counter() - began
            found[stack] = answers(out)
            rows.append((stack, seconds, len(found[stack]) / seconds * 3600))
            print(f"stack_cells={stack}: {seconds:.0f} s", file=sys.stderr, flush=True)
    differ = sum(found[False][key] != found[True].get(key) for key in found[False])
    print(f"{args.model}, {args.task}, {args.policies} at 4 ratios, {args.haystacks} haystack(s) x 4 questions")
    print("| stack_cells | seconds | answers per CPU-hour |")
    print("|---|---:|---:|")
    for stack, seconds, rate in rows:
        print(f"| {str(stack).lower()} | {seconds:.0f} | {rate:.0f} |")
    print(f"answers that differ: {differ} of {len(found[False])}")


if __name__ == "__main__":
    main()
