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

from h2o_eval import generation, harness, results, tracking
from h2o_eval.errors import ConfigError
from h2o_eval.policies import Policy, check_kernels, check_protocol, make_policy

DEFAULT_PROTOCOL = {"loglikelihood": "simulate", "generation": "prefill"}
WANDB_MODES = ("offline", "online", "disabled")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """Check every setting that needs no model; returns the config with defaults resolved.

    The protocol defaults by task kind; the ``full`` policy keeps the whole cache, so its budget is 1.0.
    """
    policy = policy_of(config)
    limit = config["limit"]
    if limit is not None and not (_is_int(limit) and limit >= 1) and not (isinstance(limit, float) and 0 < limit < 1):
        raise ConfigError(f"limit={limit!r}: use a document count >= 1, a fraction in (0, 1), or null for all")
    generating = config["task"]["kind"] == "generation"
    num_fewshot = config["num_fewshot"]
    if num_fewshot is None:
        num_fewshot = generation.template(config["task"])["num_fewshot"] if generating else 0
    if not _is_int(num_fewshot) or num_fewshot < 0:
        raise ConfigError(f"num_fewshot={num_fewshot!r}: use an integer >= 0")
    if not _is_int(config["batch_size"]) or config["batch_size"] < 1:
        raise ConfigError(f"batch_size={config['batch_size']!r}: use an integer >= 1")
    if not _is_int(config["seed"]):
        raise ConfigError(f"seed={config['seed']!r}: use an integer")
    protocol = config["protocol"] or DEFAULT_PROTOCOL[config["task"]["kind"]]
    if generating and policy.simulate_only:
        raise ConfigError(f"policy={policy.name} is a simulation of scoring only: generate with policy=h2o")
    check_protocol(policy, protocol, config["kernels"])
    if config["kernels"] == "triton":
        from h2o_eval.models import resolve_device

        check_kernels("triton", resolve_device(config["device"]).type)
    if config["wandb"]["mode"] not in WANDB_MODES:
        raise ConfigError(f"wandb.mode={config['wandb']['mode']!r}: use one of {', '.join(WANDB_MODES)}")
    for key in ("max_new_tokens", "max_words"):
        value = config["generation"][key]
        if value is not None and (not _is_int(value) or value < 1):
            raise ConfigError(f"generation.{key}={value!r}: use an integer >= 1, or null for the task's default")
    if config["data_dir"] is not None:
        (generation if generating else harness).local_data_file(config["task"], config["data_dir"])
    return {**config, "protocol": protocol, "budget": policy.budget, "num_fewshot": num_fewshot}


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


def execute(config: dict[str, Any], work_dir: Path | None = None) -> tuple[str, dict[str, Any]]:
    """:func:`run`, also saying whether the run was computed (``"ran"``) or its record existed (``"skipped"``).

    Concurrent runs of one setting (parallel sweep jobs) compute it once: the others wait, then skip.
    """
    config = validate(config)
    path = results.record_path(config["results_dir"], config)
    with results.exclusive(path):
        if path.exists() and not config["overwrite"]:
            record = results.read_record(path)
            print(f"skipped: {path} exists (overwrite=true reruns it)")
            print(summary_line(record))
            return "skipped", record
        record = _compute(config, path, work_dir)
    results.failure_path(path).unlink(missing_ok=True)
    return "ran", record


def _compute(config: dict[str, Any], path: Path, work_dir: Path | None) -> dict[str, Any]:
    from h2o_eval.models import load_model

    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="h2o_eval-"))
    start = time.perf_counter()
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
    else:
        fields, table = _loglikelihood(model, tokenizer, policy, config, work_dir)
        outputs = None
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
        **fields,
        "wall_seconds": round(time.perf_counter() - start, 3),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": results.versions(),
        "git": results.git_commit(),
        "config": config,
    }
    if outputs is not None:
        record["outputs"] = results.outputs_path(path).name
        results.write_jsonl(results.outputs_path(path), outputs)
    results.write_record(path, record)

    if table:
        print(table)
    print(summary_line(record))
    print(f"record: {path}")
    tracking.log_run(config["wandb"], record, path.stem, work_dir)
    return record


def record_failure(config: dict[str, Any], error: BaseException) -> Path:
    """Keep a failed run's error in a record of its own (``<results_dir>/failed/``), outside the results."""
    with suppress(ConfigError):  # an invalid config is named from its settings as given
        config = validate(config)
    path = results.failure_path(results.record_path(config["results_dir"], config))
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


def _loglikelihood(model, tokenizer, policy: Policy, config: dict[str, Any], work_dir: Path) -> tuple[dict, str]:
    """Score a log-likelihood task with lm-eval under ``patch``; returns (record fields, lm-eval's table)."""
    from lm_eval.utils import make_table

    from h2o_eval.backend import patch

    with patch(model, policy, protocol=config["protocol"], kernels=config["kernels"]) as session:
        output = harness.evaluate(
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
        )
    name = config["task"]["name"]
    fields = {
        "metrics": harness.metrics(output, name),
        "n_samples": output["n-samples"][name]["effective"],
        "capacity": session.capacity_stats(),
    }
    return fields, make_table(output)


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
