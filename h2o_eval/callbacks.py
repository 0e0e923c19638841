"""Hydra callbacks: settings checked before Hydra makes a run's folder, and the closing summary of a sweep."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from h2o_eval.errors import ConfigError


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """A run's settings as a plain dict (without Hydra's own node), its paths absolute from the launch folder. A
    setting that a task-dependent default cannot resolve raises its own :class:`ConfigError`."""
    missing = sorted(key for key in _missing(cfg) if not key.startswith("hydra"))
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: a required setting without a value: give it on the command line ({missing[0]}=...)"
        )
    try:
        config = OmegaConf.to_container(
            OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), resolve=True
        )
    except InterpolationResolutionError as error:
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise cause from None
    for key in ("data_dir", "results_dir"):
        if config[key] is not None:
            config[key] = to_absolute_path(config[key])
    if config["task"].get("include_path") is not None:
        config["task"]["include_path"] = to_absolute_path(config["task"]["include_path"])
    return config


def _missing(node: DictConfig, prefix: str = "") -> Iterator[str]:
    """The keys whose value is ``???`` (OmegaConf's missing mandatory value), found without resolving anything."""
    for key in node:
        if OmegaConf.is_missing(node, key):
            yield f"{prefix}{key}"
        elif isinstance(child := node._get_node(key), DictConfig):
            yield from _missing(child, f"{prefix}{key}.")


class ValidateFirst(Callback):
    """Settings and files are checked before Hydra creates ``<results_dir>/hydra/...``: a bad setting (a read-only
    ``results_dir`` included) stops a single run with one line and exit status 2, leaving nothing. A sweep checks
    every job before the first runs: under ``on_error=stop`` one invalid job stops it all, one line per invalid
    job; under ``on_error=skip`` the invalid jobs fail in their turn (:func:`h2o_eval.__main__.main`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from h2o_eval.run import fail, validate

        try:
            validate(plain_config(config))
        except ConfigError as error:
            fail(error)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.errors import HydraException

        from h2o_eval.grid import expand, one_line, refusal
        from h2o_eval.names import unknown_names
        from h2o_eval.run import fail, validate

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
