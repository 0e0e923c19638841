"""``python -m h2o_eval model=... task=... policy=... budget=...``: the Hydra app."""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from h2o_eval.callbacks import plain_config
from h2o_eval.errors import ConfigError
from h2o_eval.run import execute, fail, record_failure
from h2o_eval.threads import default_threads

STATUS_FILE = "status.json"


@hydra.main(version_base="1.3", config_path="pkg://h2o_eval.conf", config_name="config")
def main(cfg: DictConfig) -> str:
    """One run. In a sweep a failing run does not stop the others: its error goes to a record of its own,
    and every job leaves ``status.json`` (ran, skipped or failed) for the sweep's summary."""
    hydra_config = HydraConfig.get()
    config = plain_config(cfg)
    work_dir = Path(hydra_config.runtime.output_dir)
    sweeping = hydra_config.mode == RunMode.MULTIRUN
    if config["threads"] is None:
        config["threads"] = default_threads(OmegaConf.to_container(hydra_config.launcher, resolve=True))
    if sweeping and config["wandb"]["group"] is None:
        config["wandb"]["group"] = Path(hydra_config.sweep.dir).name
    status: dict[str, str] = {"overrides": " ".join(hydra_config.overrides.task)}
    try:
        status["status"], _ = execute(config, work_dir)
    except Exception as error:
        if not sweeping:
            if isinstance(error, ConfigError):
                fail(error)
            raise
        status |= {
            "status": "failed",
            "error": f"{type(error).__name__}: {error}",
            "failure_record": str(record_failure(config, error)),
        }
        print(f"failed: {status['error']}")
    (work_dir / STATUS_FILE).write_text(json.dumps(status))
    return status["status"]


if __name__ == "__main__":
    main()
