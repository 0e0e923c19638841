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
    """A single run's settings and files are checked before Hydra creates ``<results_dir>/hydra/...``: a bad
    setting (a read-only ``results_dir`` included) stops it with one line and exit status 2, leaving nothing."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from h2o_eval.run import fail, validate

        try:
            validate(plain_config(config))
        except ConfigError as error:
            fail(error)


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
