"""One run: validate the config, skip if its record exists, evaluate, write the record, log to W&B."""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from h2o_eval import data, generation, harness, hub, longcontext, results, tracking
from h2o_eval.conf import task_default
from h2o_eval.errors import ConfigError
from h2o_eval.policies import Policy, check_kernels, check_protocol, make_policy
from h2o_eval.threads import apply as apply_threads
from h2o_eval.threads import default_threads

TINY_KEPT_FRACTION = 0.1  # an integer budget keeping less than this share of the sequence is worth a warning
WANDB_MODES = ("offline", "online", "disabled")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """Check every setting and file before a model loads; returns the config with defaults resolved.

    The protocol defaults by task kind; the ``full`` policy keeps the whole cache, so its budget is 1.0.
    Data files are read and checked row by row, and the model and hub data must be reachable (in the local
    cache, or the hub online), so a bad input stops the run with one line instead of a traceback later.
    """
    policy = policy_of(config)
    limit = config["limit"]
    if limit is not None and not (_is_int(limit) and limit >= 1) and not (isinstance(limit, float) and 0 < limit < 1):
        raise ConfigError(f"limit={limit!r}: use a document count >= 1, a fraction in (0, 1), or null for all")
    kind = config["task"]["kind"]
    generating = kind in ("generation", "synthetic") or (
        kind == "lm_eval" and harness.output_type(config["task"]) == "generate_until"
    )
    num_fewshot = (
        task_default(config["task"], "num_fewshot") if config["num_fewshot"] is None else config["num_fewshot"]
    )
    if not _is_int(num_fewshot) or num_fewshot < 0:
        raise ConfigError(f"num_fewshot={num_fewshot!r}: use an integer >= 0")
    if not _is_int(config["batch_size"]) or config["batch_size"] < 1:
        raise ConfigError(f"batch_size={config['batch_size']!r}: use an integer >= 1")
    if not _is_int(config["seed"]):
        raise ConfigError(f"seed={config['seed']!r}: use an integer")
    threads = default_threads(None) if config["threads"] is None else config["threads"]
    if not _is_int(threads) or threads < 1:
        raise ConfigError(f"threads={threads!r}: use an integer >= 1, or null for the cores this job may use")
    protocol = config["protocol"] or task_default(config["task"], "protocol")
    if generating and not policy.has_cache:
        raise ConfigError(f"policy={policy.name} is a simulation of scoring only: generate with policy=h2o")
    check_protocol(policy, protocol, config["kernels"])
    if protocol == "context" and not generating and num_fewshot == 0:
        raise ConfigError(
            "protocol=context compresses a log-likelihood request's demonstrations before its question: "
            "use num_fewshot >= 1"
        )
    from h2o_eval.models import check_available, resolve_device, resolve_dtype

    device = resolve_device(config["device"])
    resolve_dtype(config["dtype"], device)
    if config["kernels"] == "triton":
        check_kernels("triton", device.type)
    if config["wandb"]["mode"] not in WANDB_MODES:
        raise ConfigError(f"wandb.mode={config['wandb']['mode']!r}: use one of {', '.join(WANDB_MODES)}")
    timeout = config["wandb"]["init_timeout"]
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise ConfigError(f"wandb.init_timeout={timeout!r}: use a number of seconds > 0")
    for key in ("max_new_tokens", "max_words"):
        value = config["generation"][key]
        if value is not None and (not _is_int(value) or value < 1):
            raise ConfigError(f"generation.{key}={value!r}: use an integer >= 1, or null for the task's default")
    fields = tuple(generation.template(config["task"])["fields"].values()) if kind == "generation" else ()
    for path in data.data_files(config):
        if path.suffix == ".jsonl":
            data.read_jsonl(path, fields)
    if kind == "lm_eval":
        harness.primary_metric(config["task"])
    if kind == "synthetic":
        longcontext.check(config["task"], config["data_dir"])
        if num_fewshot:
            raise ConfigError(f"task {config['task']['name']} has no few-shot examples: drop num_fewshot={num_fewshot}")
    elif config["data_dir"] is None and (dataset := _hub_dataset(config["task"])) is not None:
        hub.check_dataset(config["task"]["name"], dataset)
    check_available(config["model"])
    _check_writable(Path(config["results_dir"]))
    return {**config, "protocol": protocol, "budget": policy.budget, "num_fewshot": num_fewshot, "threads": threads}


def _hub_dataset(task: dict[str, Any]) -> str | None:
    """The hub dataset a task loads without ``data_dir`` (None: its lm-eval YAML names local files)."""
    return task["hub"]["path"] if task["kind"] == "generation" else harness.hub_dataset(task)


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


def policy_of(config: dict[str, Any]) -> Policy:
    """The policy a config names, with its budget and the policy group's own parameters."""
    params = {key: value for key, value in config["policy"].items() if key != "name"}
    return make_policy(config["policy"]["name"], budget=config["budget"], **params)


def run(config: dict[str, Any], work_dir: Path | None = None) -> dict[str, Any]:
    """Run one resolved config (the Hydra config as a plain dict) and return its result record.

    ``work_dir`` receives the files of this run besides its record (lm-eval task YAMLs, W&B's
    offline files); a temporary directory is used when it is None.
    """
    return execute(config, work_dir)[1]


def existing(config: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The record already at ``path``, unless ``overwrite``; an unreadable one is moved aside, with a warning, and
    the setting is run again (None)."""
    if config["overwrite"] or not path.exists():
        return None
    try:
        return results.read_record(path)
    except results.UnreadableRecord as error:
        print(f"warning: {error}; moved to {results.set_aside(path)}, running it again", file=sys.stderr)
        return None


def execute(config: dict[str, Any], work_dir: Path | None = None) -> tuple[str, dict[str, Any]]:
    """:func:`run`, also saying whether the run was computed (``"ran"``) or its record existed (``"skipped"``).

    Concurrent runs of one setting (parallel sweep jobs) compute it once: the others wait, then skip.
    """
    config = validate(config)
    path = results.record_path(config["results_dir"], config)
    with results.exclusive(path):
        if (record := existing(config, path)) is not None:
            print(f"skipped: {path} exists (overwrite=true reruns it)")
            print(summary_line(record))
            return "skipped", record
        record = _compute(config, path, work_dir)
    results.failure_path(path).unlink(missing_ok=True)
    return "ran", record


def _compute(config: dict[str, Any], path: Path, work_dir: Path | None) -> dict[str, Any]:
    from h2o_eval.models import load_model

    start = time.perf_counter()
    git = results.git_commit()  # the code that starts the run, whatever lands while it runs
    applied_threads = apply_threads(config["threads"])
    model, tokenizer = load_model(config["model"], device=config["device"], dtype=config["dtype"])
    policy = policy_of(config)
    if config["task"]["kind"] == "generation":
        fields, outputs = generation.summarise(
            model,
            tokenizer,
            config["task"],
            policy,
            protocol=config["protocol"],
            data_dir=config["data_dir"],
            num_fewshot=config["num_fewshot"],
            limit=config["limit"],
            batch_size=config["batch_size"],
            seed=config["seed"],
            settings=config["generation"],
            kernels=config["kernels"],
        )
        table = None
    elif config["task"]["kind"] == "synthetic":
        fields, outputs = longcontext.evaluate(model, tokenizer, policy, config)
        table = None
    else:
        work_dir = work_dir or Path(tempfile.mkdtemp(prefix="h2o_eval-"))
        fields, outputs, table = _lm_eval_task(model, tokenizer, policy, config, work_dir)
    seconds = time.perf_counter() - start
    return finish(config, path, policy, fields, outputs, applied_threads, seconds, git, work_dir, table)


def finish(
    config: dict[str, Any],
    path: Path,
    policy: Policy,
    fields: dict[str, Any],
    outputs: list[dict[str, Any]],
    threads: dict[str, Any],
    seconds: float,
    git: dict[str, Any],
    work_dir: Path | None = None,
    table: str | None = None,
) -> dict[str, Any]:
    """Write a computed run's record (``fields`` from its runner, ``seconds`` of wall time, ``git`` the
    :func:`~h2o_eval.results.git_commit` read when the computation started) and per-document outputs at
    ``path``, log it to W&B and print its summary line. Returns the record."""
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="h2o_eval-"))
    record = {
        "schema_version": results.SCHEMA_VERSION,
        "model": config["model"]["name"],
        "task": config["task"]["name"],
        "policy": config["policy"]["name"],
        "budget": config["budget"],
        "heavy_ratio": getattr(policy, "heavy_ratio", None),
        "protocol": config["protocol"],
        "num_fewshot": config["num_fewshot"],
        "limit": config["limit"],
        "seed": config["seed"],
        "data": data.fingerprint(config),
        **fields,
        "threads": threads,
        "wall_seconds": round(seconds, 3),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": results.versions(),
        "git": git,
        "config": config,
    }
    record["outputs"] = results.outputs_path(path).name
    results.write_jsonl(results.outputs_path(path), outputs)
    results.write_record(path, record)

    if table:
        print(table)
    tracking.log_run(config["wandb"], record, path.stem, work_dir)
    _warn_tiny_budget(record)
    print(summary_line(record))  # last, below lm-eval's table and W&B's output
    print(f"record: {path}")
    return record


def _warn_tiny_budget(record: dict[str, Any]) -> None:
    """An integer budget counts tokens: ``budget=1`` keeps one token where ``budget=1.0`` keeps everything."""
    kept = record.get("capacity", {}).get("kept_fraction_mean")
    if _is_int(record["budget"]) and kept is not None and kept < TINY_KEPT_FRACTION:
        print(
            f"warning: budget={record['budget']} is a number of tokens and kept {kept:.0%} of the sequence on "
            "average; a fraction of the sequence is a float in (0, 1] (budget=1.0 is the full cache)",
            file=sys.stderr,
        )


def record_failure(config: dict[str, Any], error: BaseException) -> Path:
    """Keep a failed run's error in a record of its own (``<results_dir>/failed/``), outside the results."""
    with suppress(ConfigError):  # an invalid config is named from its settings as given
        config = validate(config)
    try:
        record = results.record_path(config["results_dir"], config)
    except ConfigError:  # its data cannot be read, so it is named as if it read the hub's
        record = results.record_path(config["results_dir"], {**config, "data_dir": None})
    path = results.failure_path(record)
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


def _lm_eval_task(
    model, tokenizer, policy: Policy, config: dict[str, Any], work_dir: Path
) -> tuple[dict, list[dict], str]:
    """Score a task with lm-eval under ``patch`` (generating through an EvictionCache); returns (record fields,
    per-document scores, lm-eval's table)."""
    from lm_eval.utils import make_table

    from h2o_eval.backend import patch

    with patch(model, policy, protocol=config["protocol"], kernels=config["kernels"]) as session:
        output, capacity = harness.evaluate(
            model,
            tokenizer,
            config["task"],
            session,
            data_dir=config["data_dir"],
            work_dir=work_dir,
            num_fewshot=config["num_fewshot"],
            limit=config["limit"],
            batch_size=config["batch_size"],
            seed=config["seed"],
            kernels=config["kernels"],
        )
    name = config["task"]["name"]
    fields = {
        "metric": harness.primary_metric(config["task"]),
        "metrics": harness.metrics(output, name),
        "n_samples": output["n-samples"][name]["effective"],
        "capacity": capacity,
    }
    if config["task"]["kind"] == "lm_eval":
        fields["output_type"] = harness.output_type(config["task"])
    return fields, harness.document_scores(output, name), make_table(output)


def summary_line(record: dict[str, Any]) -> str:
    scores = "  ".join(
        f"{name}={value:.4f}" for name, value in record["metrics"].items() if not name.endswith("_stderr")
    )
    kept = f" (kept {record['capacity']['kept_fraction_mean']:.0%})" if "capacity" in record else ""
    return (
        f"{record['model']} | {record['task']} | {record['policy']} budget={record['budget']}{kept} "
        f"{record['protocol']} {record['num_fewshot']}-shot | n={record['n_samples']} | {scores} "
        f"| {record['wall_seconds']:.1f} s"
    )


def fail(error: ConfigError) -> None:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
