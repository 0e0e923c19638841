"""The documented commands timed as a user runs them: idle, and beside other single-thread jobs.

    python -m h2o_eval.benchmarks.commands --data-dir ../shared/data [--only main quick_leaderboard] [--runs 3]
        [--beside 0 2]

Each command (README's main job, the two quick presets, the fast tests; ``--only`` picks) runs ``--runs`` times as
a fresh process in a fresh results folder, so that nothing is skipped. ``--beside N`` runs it beside N busy
single-thread processes (each a Python loop that never waits), started before and stopped after it, as a machine
shared with other jobs is; each N in the list is one round. Prints, per command and round, each run's wall time and
CPU time (the command's processes, its children included: the tests' workers) and their median, beside the time
docs/costs.md states, the one place a documented command's time is written.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline python -m pytest -q -n auto"
COMMANDS = {
    "main": "python -m h2o_eval model=smollm2-135m task=copa policy=h2o budget=0.2 data_dir={data} results_dir={out}",
    "quick_leaderboard": "python -m h2o_eval.grid +experiment=kv_leaderboard_quick model=smollm2-135m data_dir={data} "
    "results_dir={out}",
    "quick_reasoning": "python -m h2o_eval.grid +experiment=reasoning_quick data_dir={data} results_dir={out}",
    "fast_tests": TESTS,
}
BUSY = "while True: pass"


def timed(command: str, repo: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the command and its children, exit status) of one run from ``repo``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(command, shell=True, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, done.returncode


def round_of(name: str, args: argparse.Namespace, beside: int, repo: Path) -> list[tuple[float, float, int]]:
    """``args.runs`` runs of command ``name`` beside ``beside`` busy processes."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(beside)]
    try:
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="h2o_eval-commands-") as out:
                command = COMMANDS[name].format(data=args.data_dir.resolve(), out=out)
                runs.append(timed(command.replace("python -m", f"{sys.executable} -m"), repo))
        return runs
    finally:
        for process in busy:
            process.kill()
            process.wait()


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--only", nargs="*", choices=list(COMMANDS), help="these commands (default: all)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--beside", type=int, nargs="*", default=[0, 2], help="busy processes beside it, per round")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[2]
    print(f"{os.cpu_count()} cores; {args.runs} runs per command and round")
    print("| command | beside | wall per run (m:s) | median wall | median CPU | failed |")
    print("|---|---:|---|---:|---:|---:|")
    for name in args.only or list(COMMANDS):
        for beside in args.beside:
            runs = round_of(name, args, beside, repo)
            walls = ", ".join(minutes(wall) for wall, _, _ in runs)
            wall = statistics.median(w for w, _, _ in runs)
            cpu = statistics.median(c for _, c, _ in runs)
            failed = sum(code != 0 for _, _, code in runs)
            print(f"| {name} | {beside} | {walls} | {minutes(wall)} | {minutes(cpu)} | {failed} |", flush=True)


if __name__ == "__main__":
    main()
