"""A run's settings as Hydra composed them, turned into the plain dict every run reads (:func:`plain_config`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
