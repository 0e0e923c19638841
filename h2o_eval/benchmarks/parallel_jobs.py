"""Wall time of two parallel jobs with and without the ``threads`` setting, against one job alone.

    python -m h2o_eval.benchmarks.parallel_jobs --data-dir ../shared/data
    python -m h2o_eval.benchmarks.parallel_jobs --data-dir DIR --model smollm2-135m --task piqa --limit 40

Each job is a fresh ``python -m h2o_eval`` process scoring ``--task`` (first ``--limit`` documents) with
``policy=h2o`` into its own results folder. Three cases: one job alone with every core; two jobs at once with
every core each (``threads`` = all cores, so the two compete for them); two jobs at once with
``threads`` = cores / 2 (the default under ``hydra/launcher=joblib hydra.launcher.n_jobs=2``). Prints each
case's wall and its jobs' walls (process start to exit, model loading included).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from h2o_eval.threads import available_cores


def run_jobs(count: int, threads: int, args: argparse.Namespace, folder: Path) -> tuple[float, list[float]]:
    """Start ``count`` jobs at once with ``threads`` each; (wall of all, wall of each)."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    settings = [
        f"model={args.model}",
        f"task={args.task}",
        "policy=h2o",
        f"limit={args.limit}",
        f"data_dir={args.data_dir}",
        f"threads={threads}",
        "overwrite=true",
        "wandb.mode=disabled",
    ]
    start = time.perf_counter()
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "h2o_eval", *settings, f"results_dir={folder / f'{count}x{threads}_{i}'}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    walls = []
    for job in jobs:
        _, errors = job.communicate()
        if job.returncode:
            sys.exit(f"a job failed:\n{errors[-2000:]}")
        walls.append(time.perf_counter() - start)
    return time.perf_counter() - start, walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="copa")
    parser.add_argument("--limit", default=30, type=int)
    args = parser.parse_args()
    args.data_dir = args.data_dir.resolve()
    cores = available_cores()
    cases = [
        (f"1 job alone, threads={cores}", 1, cores),
        (f"2 jobs at once, threads={cores} each (no setting)", 2, cores),
        (f"2 jobs at once, threads={max(1, cores // 2)} each (the joblib default)", 2, max(1, cores // 2)),
    ]
    print(f"{args.model} on {args.task}, {args.limit} documents, policy=h2o; {cores} cores; load {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="parallel_jobs-") as folder:
        for label, count, threads in cases:
            wall, walls = run_jobs(count, threads, args, Path(folder))
            print(f"{label:<58} wall {wall:6.1f} s   jobs {' '.join(f'{w:6.1f} s' for w in walls)}")


if __name__ == "__main__":
    main()
