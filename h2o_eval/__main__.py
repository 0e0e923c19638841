"""``python -m h2o_eval model=... task=... policy=... budget=...``: the Hydra app."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from h2o_eval.checks import check_settings
from h2o_eval.composed import plain_config
from h2o_eval.errors import ConfigError, fail, interrupted
from h2o_eval.names import unknown_keys, unknown_names
from h2o_eval.threads import default_threads

STATUS_FILE = "status.json"


@hydra.main(version_base="1.3", config_path="pkg://h2o_eval.conf", config_name="config")
def main(cfg: DictConfig) -> str:
    """One run. In a sweep a failing run does not stop the others: its error goes to a record of its own, with its
    traceback (the terminal gets one ``failed:`` line), and every job leaves ``status.json`` (ran, skipped or
    failed) for the sweep's summary."""
    hydra_config = HydraConfig.get()
    work_dir = Path(hydra_config.runtime.output_dir)
    sweeping = hydra_config.mode == RunMode.MULTIRUN
    status: dict[str, str] = {"overrides": " ".join(hydra_config.overrides.task)}
    config: dict[str, Any] | None = None
    try:
        config = plain_config(cfg)
        if config["threads"] is None:
            config["threads"] = default_threads(OmegaConf.to_container(hydra_config.launcher, resolve=True))
        if sweeping and config["wandb"]["group"] is None:
            config["wandb"]["group"] = Path(hydra_config.sweep.dir).name
        check_settings(config)  # before torch and transformers load
        from h2o_eval.run import execute, validate

        status["status"], _ = execute(validate(config), work_dir, given=config)
    except KeyboardInterrupt:
        interrupted((config or given_settings(cfg)).get("results_dir"))
    except Exception as error:
        if not sweeping:
            if isinstance(error, ConfigError):
                fail(error)
            raise
        from h2o_eval.run import record_failure

        status |= {
            "status": "failed",
            "error": f"{type(error).__name__}: {error}",
            "failure_record": str(record_failure(config or given_settings(cfg), error)),
        }
        print(f"failed: {status['error']}")
    (work_dir / STATUS_FILE).write_text(json.dumps(status))
    return status["status"]


def given_settings(cfg: DictConfig) -> dict[str, Any]:
    """A run's settings when they cannot all be resolved (a task-dependent default that fails, a missing value):
    each resolved where it can be, else None, for the failure's record."""
    settings: dict[str, Any] = {}
    for key in cfg:
        try:
            value = cfg[key]
            settings[key] = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
        except OmegaConfBaseException:
            settings[key] = None
    settings.pop("hydra", None)
    if settings.get("results_dir") is not None:
        settings["results_dir"] = to_absolute_path(settings["results_dir"])
    return settings


def check_names(argv: list[str]) -> None:
    """An unknown name on the command line (``policy=nope``, in a sweep too) or a key the config does not define
    (``budjet=0.2``, ``+budjet=0.2``) stops the app before Hydra composes a config and before torch loads: one line,
    naming what to use, and exit status 2."""
    from hydra._internal.utils import get_args_parser

    overrides = get_args_parser().parse_args(argv).overrides
    if unknown := unknown_names(overrides) or unknown_keys(overrides):
        fail(*unknown)


if __name__ == "__main__":
    check_names(sys.argv[1:])
    main()
