"""Hydra callbacks: settings checked before Hydra makes a run's folder, and the closing summary of a sweep."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from h2o_eval.composed import plain_config
from h2o_eval.errors import ConfigError


class ValidateFirst(Callback):
    """Settings and files are checked before Hydra creates ``<results_dir>/hydra/...``: a bad setting (a read-only
    ``results_dir`` included) stops a single run with one line and exit status 2, leaving nothing. A sweep checks
    every job before the first runs: under ``on_error=stop`` one invalid job stops it all, one line per invalid
    job; under ``on_error=skip`` the invalid jobs fail in their turn (:func:`h2o_eval.__main__.main`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from h2o_eval.checks import check_settings
        from h2o_eval.errors import fail

        try:
            settings = plain_config(config)
            check_settings(settings)  # before torch and transformers load
            from h2o_eval.run import validate

            validate(settings)
        except ConfigError as error:
            fail(error)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.errors import HydraException

        from h2o_eval.errors import fail
        from h2o_eval.grid import one_line, refusal
        from h2o_eval.names import expand, unknown_names
        from h2o_eval.run import validate

        params = config.hydra.sweeper.get("params") or {}
        # the jobs as Hydra's basic sweeper makes them: the preset's sweeps, then the command line's over them
        overrides = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
        if unknown := unknown_names(overrides):
            fail(*unknown)
        if config.on_error == "skip":
            return
        loader = GlobalHydra.instance().config_loader()
        jobs = expand(overrides)
        refused = []
        for job in jobs:
            try:
                validate(plain_config(loader.load_sweep_config(config, job)))
            except HydraException as error:
                refused.append(refusal(job, jobs, one_line(error)))
            except ConfigError as error:
                refused.append(refusal(job, jobs, error))
        if refused:
            fail(*refused)


class SweepSummary(Callback):
    """After ``--multirun``: how many jobs ran, were skipped (record existed) or failed, and why. A sweep with
    a failed job exits with status 1 once every job has had its turn."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        statuses = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/status.json"))]
        counts = Counter(s["status"] for s in statuses)
        print(f"sweep {sweep_dir}: {counts['ran']} ran, {counts['skipped']} skipped, {counts['failed']} failed")
        for status in statuses:
            if status["status"] == "failed":
                print(f"  failed: {status['overrides']}: {status['error']} (record: {status['failure_record']})")
        if counts["failed"]:
            sys.exit(1)
