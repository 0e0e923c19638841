"""``python -m h2o_eval.grid OVERRIDES``: a ``--multirun`` sweep of long-context tasks that computes each prompt once.

    python -m h2o_eval.grid model=smollm2-135m task=niah_single_1,niah_multikey_1 task.length=1024,2048 \\
        ++task.max_new_tokens=32 limit=20 policy=full,h2o,snapkv budget=0.1,0.25 protocol=prefill,context \\
        data_dir=../shared/data results_dir=RUNS

The overrides and their comma sweeps are Hydra's, expanded as ``--multirun`` would; every cell becomes the
record ``python -m h2o_eval`` would write for it (same identity, same file; existing records are skipped). Cells
of a long-context task that differ only in policy, budget (or threshold) and protocol (``prefill`` or ``context``)
run together in one process: per batch of documents, the prompt (or context), which attends in full whatever the
policy, is computed once and every cell's cache compresses it by its own policy (the runner's ``evaluate_shared``),
the cells that differ only in budget after one run of their policy's extra passes (KVzip's repeat); each cell then
generates alone. Loading, timing and record writing are ``python -m h2o_eval``'s own
(:func:`h2o_eval.run.compute`). The prompt's attention is then the full cache's for every cell, so a cell can differ
from its separate run by floating-point rounding there, nowhere else. Other cells run one by one.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from h2o_eval.errors import ConfigError

if TYPE_CHECKING:
    from h2o_eval.run import Spec

SHARED_KEYS = ("policy", "budget", "threshold", "protocol")


def preset_sweep(overrides: list[str]) -> list[str]:
    """``overrides`` plus the sweeps a preset among them declares (``hydra.sweeper.params``, as ``--multirun``
    reads them: ``+experiment=kv_leaderboard``), for the keys the command line does not sweep or set itself."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from h2o_eval.names import compose as compose_config
    from h2o_eval.names import expand

    first = expand(overrides)[0] if overrides else []
    try:
        config = compose_config(first, hydra=True)
    except HydraException:
        return overrides  # compose() names the error, cell by cell
    given = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    params = config.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params) if params is not None else {}
    return overrides + [f"{key}={value}" for key, value in params.items() if key not in given]


def refusal(cell: list[str], cells: list[list[str]], error: object) -> str:
    """One line for a cell of a sweep that cannot run: the overrides that set it apart from the other ``cells``
    (``budget=1.5``), then why; an override the error begins with (``policy=streaming``, or its value
    ``streaming``) is said once."""
    swept = [override for i, override in enumerate(cell) if len({other[i] for other in cells}) > 1]
    said = str(error)
    named = [o for o in swept if not said.startswith((f"{o}:", f"{o.split('=', 1)[-1]}:"))]  # the error names it
    return f"{' '.join(named)}: {said}" if named else said


def one_line(error: Exception) -> str:
    """Hydra's message for a config it cannot compose, on one line, without its config search path."""
    lines = [line.strip() for line in str(error).split("Config search path")[0].splitlines() if line.strip()]
    return lines[0] + (f" ({lines[1]} {', '.join(lines[2:])})" if len(lines) > 2 else "")


def compose(overrides: list[str]) -> dict[str, Any]:
    """One cell's resolved config, as ``python -m h2o_eval`` builds it (not yet validated). An unknown name, a
    config Hydra cannot compose, or a task setting its task does not take, stops the whole sweep with one line."""
    from hydra.errors import HydraException

    from h2o_eval.composed import plain_config
    from h2o_eval.names import compose as compose_config
    from h2o_eval.names import unknown_names
    from h2o_eval.runners import check_task_keys
    from h2o_eval.threads import default_threads

    if unknown := unknown_names(overrides):
        raise ConfigError(unknown[0])
    try:
        config = plain_config(compose_config(overrides))
    except HydraException as error:
        raise ConfigError(one_line(error)) from None
    check_task_keys(config["task"])
    if config["threads"] is None:
        config["threads"] = default_threads(None)
    return config


def groups(specs: list[Spec]) -> list[list[Spec]]:
    """Validated cells whose runner can share their prompt passes, grouped by everything but policy, budget,
    threshold and protocol; every other cell alone."""
    together: dict[str, list[Spec]] = {}
    alone = []
    for spec in specs:
        if spec.runner.shares_prompts(spec.config):
            kept = {k: v for k, v in spec.config.items() if k not in SHARED_KEYS}
            key = json.dumps(kept | {"conversation": spec.config["protocol"] == "turns"}, sort_keys=True)
            together.setdefault(key, []).append(spec)
        else:
            alone.append([spec])
    return list(together.values()) + alone


def main(argv: list[str]) -> None:
    """Compose every cell (an unknown name or a typo stops all) and validate each: under ``on_error=stop`` an
    invalid cell stops the grid before anything runs, one line per invalid cell; under ``on_error=skip`` the
    invalid ones are refused (a line each, and exit status 1 at the end) and the others run. Cells with records
    are skipped, the rest computed. A group of cells is locked while it is computed
    (:func:`~h2o_eval.run.computed_once`): a second grid over the same cells, in a lane or on another node
    sharing the folder, waits for it, then takes the records it wrote and computes only what is left."""
    from h2o_eval import results
    from h2o_eval.errors import fail, interrupted
    from h2o_eval.names import expand, unknown_keys, unknown_names
    from h2o_eval.run import existing, summary_line, validate

    overrides = preset_sweep(argv)
    if unknown := unknown_names(overrides) or unknown_keys(overrides):
        fail(*unknown)
    swept = expand(overrides)
    try:
        cells = [(cell, compose(cell)) for cell in swept]
    except ConfigError as error:
        fail(error)
    specs, refused = [], []
    for cell, config in cells:
        try:
            specs.append(validate(config))
        except ConfigError as error:
            refused.append(refusal(cell, swept, error))
    if refused and cells[0][1]["on_error"] != "skip":
        fail(*refused)
    todo, paths = [], set()
    for spec in specs:
        if spec.path in paths:  # one record for cells that are one setting (``full`` at any budget, say)
            continue
        paths.add(spec.path)
        if existing(spec.config, spec.path) is not None:
            print(f"skipped: {results.stored(spec.path)} exists (overwrite=true reruns it)")
        else:
            todo.append(spec)
    print("\n".join(f"refused: {line}" for line in refused))
    print(f"{len(paths)} cells, {len(paths) - len(todo)} with records, {len(todo)} to compute, {len(refused)} refused")
    try:
        done = compute_groups(todo)
    except KeyboardInterrupt:
        interrupted(cells[0][1]["results_dir"])
    if done:
        print("\n".join(["summary:", *(summary_line(record, spec.departures) for spec, record in done)]))
    if refused:
        sys.exit(1)


def compute_groups(todo: list[Spec]) -> list[tuple[Spec, dict[str, Any]]]:
    """Compute ``todo``, a group of cells that share their prompts at a time, each cell alone otherwise: each spec
    with its record."""
    from h2o_eval import results
    from h2o_eval.run import computed_once, execute

    done = []
    for group in groups(todo):
        if len(group) == 1:
            done.append((group[0], execute(group[0])[1]))
            continue
        print(f"{len(group)} cells of {group[0].config['task']['name']} share their prompts")
        for spec, (status, record) in zip(group, computed_once(group), strict=True):
            if status == "skipped":  # another grid computed it while this one waited
                print(f"skipped: {results.stored(spec.path)} was written meanwhile")
            done.append((spec, record))
    return done


if __name__ == "__main__":
    main(sys.argv[1:])
