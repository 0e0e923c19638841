"""Whether a change of the code changed any number: a fixed set of runs on SmolLM2, one folder per setting, and the
comparison of two such sets record by record.

    python -m h2o_eval.benchmarks.same_numbers run OUT --data-dir ../shared/data    # at each of the two commits
    python -m h2o_eval.benchmarks.same_numbers compare BEFORE AFTER

The settings cover every runner and protocol and the paths a refactor of the run can break: log-likelihood under
``simulate`` and 5-shot ``prefill``, summarisation, a long-context task under ``context``, extra passes (KVzip) and
the oracle's full-cache answer, and the grid's shared prompt with stacked cells. Records are paired by the hash of
their identity (the end of their file name), so a new file name still finds its pair. Two sets agree when every
pair has the same metrics, the same capacity statistics and, document by document, the same outputs. BEFORE and
AFTER may also be two grids' ``results_dir`` (the same cells run by two versions), compared as one setting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

COMMON = ["model=smollm2-135m", "wandb.mode=disabled", "threads=1"]
SETTINGS: dict[str, list[str]] = {
    "copa_simulate_h2o": ["task=copa", "limit=100", "policy=h2o", "budget=0.2"],
    "piqa_5shot_prefill_snapkv": ["task=piqa", "num_fewshot=5", "limit=50", "protocol=prefill", "policy=snapkv"],
    "xsum_prefill_h2o": ["task=xsum", "num_fewshot=1", "limit=5", "batch_size=5", "policy=h2o"],
    "niah_context_tova": [
        "task=niah_single_2", "task.length=1024", "limit=4", "batch_size=4", "protocol=context", "policy=tova",
        "budget=0.25",
    ],
    "niah_context_passes": [
        "task=niah_single_2", "task.length=1024", "limit=4", "batch_size=2", "protocol=context", "decoding=grow",
        "policy=kvzip,oracle", "budget=0.25",
    ],
    "niah_grid_stacked": [
        "+experiment=kv_leaderboard_shared", "task=niah_single_2", "task.length=1024", "limit=2", "batch_size=2",
        "policy=full,snapkv,adakv,h2o,oracle", "budget=0.5", "stack_cells=true",
    ],
    "niah_grid_prefill": [
        "task=niah_single_2", "task.length=1024", "limit=4", "batch_size=4", "protocol=prefill",
        "policy=full,snapkv,adakv,kvzip", "budget=0.25",
    ],
}  # fmt: skip
CAPACITY = "capacity"


def run(out: Path, data_dir: Path) -> None:
    """Each setting through ``python -m h2o_eval.grid`` of this interpreter into ``out/<setting>``."""
    for name, overrides in SETTINGS.items():
        print(f"=== {name}", flush=True)
        args = [*COMMON, *overrides, f"data_dir={data_dir.resolve()}", f"results_dir={(out / name).resolve()}"]
        subprocess.run([sys.executable, "-m", "h2o_eval.grid", *args], check=True)


def _records(folder: Path) -> dict[str, dict[str, Any]]:
    """The records of a folder by the hash of their identity, each with its outputs (``rows``)."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        outputs = folder / record["outputs"]
        record["rows"] = [json.loads(line) for line in outputs.read_text().splitlines()] if outputs.is_file() else []
        found[path.stem.rsplit("__", 1)[1]] = record
    return found


def _row(row: dict[str, Any]) -> dict[str, Any]:
    """What a document's output says, without what varies from run to run (timings)."""
    return {key: value for key, value in row.items() if "seconds" not in key and not key.endswith("_per_s")}


def _settings(before: Path, after: Path) -> list[str]:
    """The settings two folders hold: those of :data:`SETTINGS` that either has (folders ``run`` wrote), else the
    folders themselves (``.``: two grids' ``results_dir``). Two folders without a record are refused: they
    would agree on nothing."""
    named = [name for name in SETTINGS if (before / name).is_dir() or (after / name).is_dir()]
    if named:
        return named
    if any(before.glob("*.json")) or any(after.glob("*.json")):
        return ["."]
    raise SystemExit(
        f"error: no records in {before} or {after}: compare two folders that `same_numbers run` wrote, or two "
        "results_dir"
    )


def compare(before: Path, after: Path) -> bool:
    """Print a line per record pair: its setting, its headline metric before and after, and what differs; returns
    whether every pair agrees and every record has a pair."""
    same, settings = True, _settings(before, after)
    print("| setting | record | metric | before | after | differs in |")
    print("|---|---|---|---:|---:|---|")
    for name in settings:
        old, new = _records(before / name), _records(after / name)
        for digest in sorted(old.keys() | new.keys()):
            a, b = old.get(digest), new.get(digest)
            if a is None or b is None:
                same = False
                print(f"| {name} | {digest} | | | | {'only after' if a is None else 'only before'} |")
                continue
            metric = next(iter(a["metrics"]))
            differs = [
                label
                for label, x, y in (
                    ("metrics", a["metrics"], b["metrics"]),
                    (CAPACITY, a.get(CAPACITY), b.get(CAPACITY)),
                    ("outputs", [_row(r) for r in a["rows"]], [_row(r) for r in b["rows"]]),
                )
                if x != y
            ]
            same = same and not differs
            base = a["config"]["policy"].get("base")  # Ada-KV over Expected Attention or over Compactor, say
            base = base.get("name") if isinstance(base, dict) else base
            policy = a["policy"] + (f"({base})" if base else "") + (f"@{a['budget']}" if a["policy"] != "full" else "")
            print(
                f"| {name} | {policy} | {metric} | {a['metrics'][metric]:.4f} | {b['metrics'][metric]:.4f} "
                f"| {', '.join(differs) or 'nothing'} |"
            )
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    running = commands.add_parser("run", help="run every setting into OUT")
    running.add_argument("out", type=Path)
    running.add_argument("--data-dir", type=Path, required=True)
    comparing = commands.add_parser("compare", help="compare two folders that `run` wrote")
    comparing.add_argument("before", type=Path)
    comparing.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.data_dir)
    elif not compare(args.before, args.after):
        sys.exit(1)


if __name__ == "__main__":
    main()
