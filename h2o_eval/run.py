"""One run: validate the config, skip if its record exists, evaluate with the task's runner, write the record, log
to W&B. :func:`compute` is also the grid's: a group of cells that share one model load and, where the runner can,
their prompt passes."""

from __future__ import annotations

import hashlib
import json
import re
import resource
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from h2o_eval import packs, results, settings, tracking
from h2o_eval.checks import check_settings, is_int
from h2o_eval.errors import ConfigError
from h2o_eval.policies import (
    Policy,
    check_decoding,
    check_kernels,
    check_protocol,
    configured_interval,
    configured_policy,
)
from h2o_eval.policies.base import HISTORIES, SCHEDULES, refuse_interval_policy
from h2o_eval.runners import Evaluation, Runner, check_generation_keys, check_task_keys, runner_of
from h2o_eval.threads import apply as apply_threads
from h2o_eval.threads import default_threads

TINY_KEPT_FRACTION = 0.1  # an integer budget keeping less than this share of the sequence is worth a warning
PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class Spec:
    """A validated run, built once: its config with the defaults resolved, its task's runner, its built policy, its
    identity (the settings, the policy as built and the data's hash: :func:`h2o_eval.results.identity`), the
    path of its record, its settings that depart from the defaults (:func:`h2o_eval.settings.departures`), which
    its summary line names, and the record path of the run its outputs are set beside (the runner's
    :meth:`~h2o_eval.runners.Runner.reference`), or None."""

    config: dict[str, Any]
    runner: Runner
    policy: Policy
    identity: dict[str, Any]
    path: Path
    departures: dict[str, Any]
    reference: Path | None = None


def validate(config: dict[str, Any]) -> Spec:
    """Check every setting and file before a model loads, and build the run's :class:`Spec`.

    The protocol and the shots default to the task runner's; the ``full`` policy keeps the whole cache, so its
    budget is 1.0. The runner checks the task's settings and reads its data files row by row, and the model and
    hub data must be reachable (in the local cache, or the hub online), so a bad input stops the run with one line
    instead of a traceback later.
    """
    check_settings(config)
    task = config["task"]
    check_task_keys(task)
    check_generation_keys(config)
    policy = configured_policy(config)
    runner = runner_of(task)
    num_fewshot = runner.default_fewshot(task) if config["num_fewshot"] is None else config["num_fewshot"]
    stack = config["stack_cells"]
    protocol = config["protocol"] or runner.default_protocol(task)
    if stack and (
        runner.name != "long_context" or protocol not in ("context", "turns") or config["decoding"] != "grow"
    ):
        raise ConfigError(
            "stack_cells=true answers the cells of a RULER-style task together under protocol=context or turns, "
            "decoding=grow only: set those, or stack_cells=false"
        )
    threads = default_threads(None) if config["threads"] is None else config["threads"]
    if (reason := runner.refusal(task, policy)) is not None:
        raise ConfigError(f"policy={policy.name} {reason}")
    check_protocol(policy, protocol, config["kernels"])
    check_decoding(protocol, config["decoding"], policy)
    configured_interval(config, policy)
    if protocol == "turns":
        check_turns(config, policy, runner.name)
    from h2o_eval.models import check_available, resolve_device, resolve_dtype

    device = resolve_device(config["device"])
    resolve_dtype(config["dtype"], device)
    if config["kernels"] == "triton":
        check_kernels("triton", device.type)
    resolved = {**config, "protocol": protocol, "budget": policy.budget, "num_fewshot": num_fewshot, "threads": threads}
    check_available(config["model"])
    runner.check(resolved)
    _check_writable(Path(config["results_dir"]))
    ident = results.identity(resolved, policy)
    path = results.record_path(resolved["results_dir"], resolved, ident)
    reference = runner.reference(resolved)
    beside = None if reference is None else results.record_path(resolved["results_dir"], reference)
    return Spec(resolved, runner, policy, ident, path, settings.departures(resolved, ident["built_policy"]), beside)


def check_turns(config: dict[str, Any], policy: Any, runner: str) -> None:
    """``protocol=turns``' settings: a long-context task of several questions (its turns), a known history and
    schedule, and under ``nested`` or ``new_turn`` a policy a turn's compression can score with a fractional
    budget."""
    turns = dict(config.get("turns") or {})
    if unknown := set(turns) - {"history", "schedule"}:
        raise ConfigError(f"turns takes no {', '.join(sorted(unknown))}: its settings are history, schedule")
    if runner != "long_context":
        raise ConfigError("protocol=turns asks a RULER-style task's questions as turns: use task=niah_single_1 or "
                          "another long-context task, or protocol=context")  # fmt: skip
    if (count := config["task"].get("questions") or 1) < 2:
        raise ConfigError(f"protocol=turns needs two questions or more per context (task.questions={count}): set "
                          "task.questions=4")  # fmt: skip
    if turns.get("history") not in HISTORIES:
        raise ConfigError(f"turns.history={turns.get('history')!r}: use one of {', '.join(HISTORIES)}")
    schedule = turns.get("schedule")
    if schedule not in SCHEDULES:
        raise ConfigError(f"turns.schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    if schedule == "once":
        return
    if not isinstance(policy.budget, float):
        raise ConfigError(f"turns.schedule={schedule} keeps a fraction of each turn: use a fractional budget, not "
                          f"budget={policy.budget}")  # fmt: skip
    refuse_interval_policy(policy, f"turns.schedule={schedule}", "a turn's", "; or turns.schedule=once")


def _check_writable(results_dir: Path) -> None:
    """``results_dir``, or the folder that would hold it, must take a file (tried, as root ignores modes)."""
    existing = next(folder for folder in (results_dir, *results_dir.parents) if folder.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(
            f"results_dir={results_dir} is not writable ({error.strerror}: {existing}): pick another results_dir"
        ) from None


def run(config: dict[str, Any], work_dir: Path | None = None) -> dict[str, Any]:
    """Run one resolved config (the Hydra config as a plain dict) and return its result record.

    ``work_dir`` receives the files of this run besides its record (W&B's offline run); ``results_dir`` when it
    is None, so nothing lands in the system's temporary folder.
    """
    return execute(validate(config), work_dir)[1]


def existing(config: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The record of ``path``'s setting (:func:`~h2o_eval.results.stored`), unless ``overwrite``; an unreadable one
    is moved aside, with a warning, and the setting is run again (None)."""
    found = None if config["overwrite"] else results.stored(path)
    if found is None:
        return None
    try:
        return results.read_record(found)
    except results.UnreadableRecord as error:
        print(f"warning: {error}; moved to {results.set_aside(found)}, running it again", file=sys.stderr)
        return None


def execute(
    spec: Spec, work_dir: Path | None = None, given: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """Run a validated run: its record is computed (``"ran"``) or was there (``"skipped"``); returns which, and
    the record.

    Concurrent runs of one setting (parallel sweep jobs) compute it once: the others wait, then skip
    (:func:`computed_once`). A computed run removes the failure record an earlier failure of its settings as
    ``given`` left (:func:`record_failure`).
    """
    [(status, record)] = computed_once([spec], work_dir)
    if status == "skipped":
        print(f"skipped: {results.stored(spec.path)} exists (overwrite=true reruns it)")
        print(summary_line(record, spec.departures))
    elif given is not None:
        failure_path(given).unlink(missing_ok=True)
    return status, record


def computed_once(specs: list[Spec], work_dir: Path | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Per cell of ``specs`` (computed together, :func:`compute`), ``"ran"`` or ``"skipped"`` (its record was
    there) and its record, under each record's :func:`~h2o_eval.results.exclusive` lock, taken in one order in every
    process: a process given cells another is computing waits, then takes the records it wrote and computes only
    what is left."""
    with ExitStack() as locks:
        for path in sorted(spec.path for spec in specs):
            locks.enter_context(results.exclusive(path))
        found = [existing(spec.config, spec.path) for spec in specs]
        left = [spec for spec, record in zip(specs, found, strict=True) if record is None]
        computed = iter(compute(left, work_dir) if left else [])
        return [("skipped", record) if record is not None else ("ran", next(computed)) for record in found]


def compute(specs: list[Spec], work_dir: Path | None = None) -> list[dict[str, Any]]:
    """Compute validated cells of one model and task that differ only in policy, budget (or threshold) and
    protocol, and write their records: one model load; the runner evaluates them together where it can share their
    prompt passes (:meth:`~h2o_eval.runners.Runner.evaluate_shared`), else one by one. Returns the records, in
    order."""
    from h2o_eval.generation.partial import Partial
    from h2o_eval.models import load_model

    first = specs[0].config
    git = results.git_commit()  # the code that starts the run, whatever lands while it runs
    applied_threads = apply_threads(first["threads"])
    began, began_cpu = time.perf_counter(), time.process_time()
    model, tokenizer = load_model(first["model"], device=first["device"], dtype=first["dtype"])
    loaded, loaded_cpu = time.perf_counter(), time.process_time()
    device = next(model.parameters()).device
    runner = specs[0].runner
    made = {"device": str(device), "threads": applied_threads["torch"]}  # what may change an answer's rounding
    shared = len(specs) > 1 and all(runner.shares_prompts(spec.config) for spec in specs)
    evaluations, peaks, partials = [], [], []
    for group in [specs] if shared else [[spec] for spec in specs]:
        peak = PeakMemory(device)  # one peak for the cells evaluated together
        paths = [spec.path for spec in group]  # where the answers so far are kept (generation/partial.py)
        partials.append(Partial(results.partial_path(paths, group[0].config), [path.name for path in paths], git, made))
        cells = [(spec.policy, spec.config) for spec in group]
        evaluated = runner.evaluate_shared(model, tokenizer, cells, partials[-1])
        peaks.extend([peak.read()] * len(group))
        if shared:
            for evaluation in evaluated:
                evaluation.fields["generation"]["shared_prompt_cells"] = len(group)
        evaluations.extend(evaluated)
    for spec, evaluation in zip(specs, evaluations, strict=True):
        if spec.reference is not None:
            runner.compare(model, tokenizer, spec.config, evaluation, results.stored_outputs(spec.reference))
    seconds = (time.perf_counter() - loaded) / len(specs)
    cpu = (time.process_time() - loaded_cpu) / len(specs)
    walls = []
    for evaluation, peak in zip(evaluations, peaks, strict=True):
        earlier = evaluation.fields.get("generation", {}).get("resumed") or {}  # a stopped run's share, taken up
        # a first load converts the weights once (about 100 s for Gemma 3)
        evaluation.fields["load_seconds"] = round(loaded - began, 3)
        evaluation.fields["load_cpu_seconds"] = round(loaded_cpu - began_cpu, 3)
        evaluation.fields["cpu_seconds"] = round(cpu + earlier.get("cpu_seconds", 0.0), 3)
        evaluation.fields["peak_memory"] = peak
        walls.append(seconds + earlier.get("wall_seconds", 0.0))
    records = [
        finish(spec, evaluation, applied_threads, wall, git, work_dir)
        for spec, evaluation, wall in zip(specs, evaluations, walls, strict=True)
    ]
    for kept in partials:
        kept.finish()
    return records


def finish(
    spec: Spec,
    evaluation: Evaluation,
    threads: dict[str, Any],
    seconds: float,
    git: dict[str, Any],
    work_dir: Path | None = None,
) -> dict[str, Any]:
    """Write a computed run's record (the runner's ``evaluation``, ``seconds`` of wall time of the evaluation
    itself, the model's load apart as ``load_seconds``; their CPU time, every thread's, as ``cpu_seconds`` and
    ``load_cpu_seconds``; ``git`` the
    :func:`~h2o_eval.results.git_commit` read when the computation started) and per-document outputs at
    its path, log it to W&B (its offline run under ``work_dir``, else under ``results_dir``) and print its summary
    line. Returns the record."""
    config, policy, path = spec.config, spec.policy, spec.path
    record = {
        "schema_version": results.SCHEMA_VERSION,
        "model": config["model"]["name"],
        "task": config["task"]["name"],
        "policy": config["policy"]["name"],
        "budget": config["budget"],
        "heavy_ratio": getattr(policy, "heavy_ratio", None),
        "policy_params": policy.describe(),
        **({"interval_params": spec.identity["interval"]} if "interval" in spec.identity else {}),
        "protocol": config["protocol"],
        "num_fewshot": config["num_fewshot"],
        "limit": config["limit"],
        "seed": config["seed"],
        "data": spec.identity["data"],
        **evaluation.fields,
        "threads": threads,
        "wall_seconds": round(seconds, 3),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": results.versions(),
        "git": git,
        "config": config,
    }
    outputs = packs.outputs_path(path)
    record["outputs"] = outputs.name
    results.write_jsonl(outputs, evaluation.outputs)
    results.write_record(path, record)

    line = summary_line(record, spec.departures)  # printed last, below lm-eval's table
    if evaluation.table:
        print(evaluation.table)
    tracking.log_run(config["wandb"], record, path.stem, work_dir or Path(config["results_dir"]))
    _warn_tiny_budget(record)
    print(line)
    print(f"record: {path}")
    return record


class PeakMemory:
    """An evaluation's peak memory on ``device`` (a torch device) from its creation on: the CUDA allocator's peak,
    or on the CPU the process's peak resident set (Linux resets it through ``/proc/self/clear_refs``; where that is
    not permitted the peak is the process's since it started, and :meth:`read` says so)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        self.resident_reset = False
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        with suppress(OSError):
            PROC_CLEAR_REFS.write_text("5")
            self.resident_reset = True

    def read(self) -> dict[str, Any]:
        """The record's ``peak_memory``: ``device`` (cpu or cuda), ``bytes`` and ``kind``: ``allocator`` (CUDA's
        ``max_memory_allocated``: tensors, the weights included, not the allocator's reserve), ``resident set``
        (the process's ``VmHWM``), or ``resident set since the process started`` (``ru_maxrss``, where the peak
        could not be reset or read). An output of the run, never part of its identity."""
        import torch

        if self.device.type == "cuda":
            return {"device": "cuda", "bytes": torch.cuda.max_memory_allocated(self.device), "kind": "allocator"}
        hwm = _vm_hwm()
        if hwm is not None and self.resident_reset:
            return {"device": "cpu", "bytes": hwm, "kind": "resident set"}
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in kB on Linux, bytes on macOS
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        return {"device": "cpu", "bytes": maxrss, "kind": "resident set since the process started"}


def _vm_hwm() -> int | None:
    """The process's peak resident set in bytes (``VmHWM`` of ``/proc/self/status``), or None without it."""
    try:
        lines = PROC_STATUS.read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM:")), None)


def _warn_tiny_budget(record: dict[str, Any]) -> None:
    """An integer budget counts tokens: ``budget=1`` keeps one token where ``budget=1.0`` keeps everything."""
    kept = record.get("capacity", {}).get("kept_fraction_mean")
    if is_int(record["budget"]) and kept is not None and kept < TINY_KEPT_FRACTION:
        print(
            f"warning: budget={record['budget']} is a number of tokens and kept {kept:.0%} of the sequence on "
            "average; a fraction of the sequence is a float in (0, 1] (budget=1.0 is the full cache)",
            file=sys.stderr,
        )


def failure_path(config: dict[str, Any]) -> Path:
    """Where a failed run's error is kept: ``<results_dir>/failed/``, in a file named like a record (model, task,
    policy, budget, protocol, shots, hash) but from the settings as given, the hash covering those that make a
    record's identity. A record's own name needs the built policy and the data's content, which an invalid setting
    may not give: nothing here builds or reads anything that could fail again."""
    settings = {key: value for key, value in config.items() if key not in results.NOT_IDENTITY}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]

    def name(key: str) -> Any:
        value = config.get(key)
        return value.get("name") if isinstance(value, dict) else value

    parts = [
        name("model"),
        name("task"),
        name("policy"),
        f"b{config.get('budget')}",
        config.get("protocol"),
        f"{config.get('num_fewshot')}shot",
        digest,
    ]
    file_name = "__".join(re.sub(r"[^\w.+-]", "_", str(part)) for part in parts)
    return Path(config.get("results_dir") or "results") / "failed" / f"{file_name}.json"


def record_failure(config: dict[str, Any], error: BaseException) -> Path:
    """Keep a failed run's error, its traceback and its settings as given in a record of its own
    (:func:`failure_path`), outside the results. Returns its path."""
    path = failure_path(config)
    results.write_record(
        path,
        {
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exception(error),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": config,
        },
    )
    return path


def summary_line(record: dict[str, Any], found: dict[str, Any]) -> str:
    """One line naming the run's setting (with the prompt length, the questions per context, the decoding rule
    and every departure from the defaults, ``found``: :attr:`Spec.departures`), its scores and its wall time."""
    config = record["config"]
    metrics = record["metrics"]
    scores = "  ".join(
        f"{name}={value:.4f}" for name, value in metrics.items() if not re.search(r"_stderr$|_n$|_turn\d+$", name)
    )
    if turns := [value for name, value in metrics.items() if re.search(r"_turn\d+$", name)]:
        scores += f"  by turn: {' '.join(f'{value:.2f}' for value in turns)}"
    kept = f" (kept {record['capacity']['kept_fraction_mean']:.0%})" if "capacity" in record else ""
    params = [settings.label(key, value) for key, value in found.items() if key.startswith("policy.")]
    named = ("decoding", "task.questions", "turns.history", "turns.schedule")
    others = [
        settings.label(key, value) for key, value in found.items() if not key.startswith("policy.") and key not in named
    ]
    task = record["task"]
    if (count := settings.questions(config)) is not None:
        task += f" ({config['task']['length']} tokens, {settings.questions_label(count)})"
    protocol = record["protocol"] + (f" decoding={config['decoding']}" if record["protocol"] != "simulate" else "")
    if record["protocol"] == "turns":
        protocol += f" history={config['turns']['history']} schedule={config['turns']['schedule']}"
    budget = "no budget" if record["policy_params"]["name"] == "dms" else f"budget={record['budget']}"  # a threshold
    return (
        f"{record['model']} | {task} | {' '.join([record['policy'], *params])} {budget}{kept} "
        f"{protocol} {record['num_fewshot']}-shot{''.join(f' {o}' for o in others)} "
        f"| n={record['n_samples']} | {scores} | {record['wall_seconds']:.1f} s"
    )
