"""h2o_eval's Hydra configs. Importing the package (Hydra does, to read them) registers the resolver that
``config.yaml`` uses for task-dependent defaults, so ``--cfg job`` shows the values a run will use."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml
from omegaconf import OmegaConf


def options(group: str) -> dict[str, dict[str, Any]]:
    """Every option of a config group (``task``, ``model``, ...) mapped to its config, the contents of
    ``conf/<group>/<name>.yaml``, as the CLI sees them; an option in a folder of the group is named by its path
    (``policy=kvpress/snapkv``: ``conf/policy/kvpress/snapkv.yaml``, a policy's configuration as kvpress runs it).
    The files are read once per process (a grid checks every cell's names); each caller gets its own copy."""
    return copy.deepcopy(_read(group))


@functools.cache
def _read(group: str) -> dict[str, dict[str, Any]]:
    folder = resources.files(__name__) / group
    entries = [(entry, "") for entry in folder.iterdir()]
    entries += [(inner, f"{entry.name}/") for entry in folder.iterdir() if entry.is_dir() for inner in entry.iterdir()]
    return {
        prefix + entry.name.removesuffix(".yaml"): yaml.safe_load(entry.read_text())
        for entry, prefix in entries
        if entry.name.endswith(".yaml")
    }


def listed(group: str) -> list[str]:
    """The options of a config group that a user picks from, sorted: every one but the models with random weights
    (``source: random``: the tests' tiny models, and real models' shapes for timing), which work when named but are
    left out of every list of names."""
    return sorted(
        name for name, config in options(group).items() if not (group == "model" and config.get("source") == "random")
    )


def task_default(task: Mapping[str, Any], setting: str) -> Any:
    """``protocol`` or ``num_fewshot`` when not given: what the task's runner says (simulate and 0 shots for
    log-likelihood tasks; prefill, and the template's or the lm-eval YAML's shots, for generation)."""
    from h2o_eval.runners import runner_of

    runner = runner_of(task)
    return runner.default_protocol(task) if setting == "protocol" else runner.default_fewshot(task)


def pick(key: Any, table: Mapping[str, Any], default: Any) -> Any:
    """``${pick:KEY,{KEY: VALUE, ...},DEFAULT}``: a setting chosen by another, e.g. the decoding rule by the policy's
    name in a preset whose cells differ in more than one swept value (``+experiment=reasoning``)."""
    return table.get(key, default)


OmegaConf.register_new_resolver(
    "task_default", lambda setting, _root_: task_default(dict(_root_.task), setting), replace=True
)
OmegaConf.register_new_resolver("pick", pick, replace=True)
