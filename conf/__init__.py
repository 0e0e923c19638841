"""h2o_eval's Hydra configs. Importing the package (Hydra does, to read them) registers the resolver that
``config.yaml`` uses for task-dependent defaults, so ``--cfg job`` shows the values a run will use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

DEFAULT_PROTOCOL = {"loglikelihood": "simulate", "generation": "prefill", "synthetic": "prefill"}


def task_default(task: Mapping[str, Any], setting: str) -> Any:
    """``protocol`` or ``num_fewshot`` when not given: simulate and 0 shots for log-likelihood tasks; prefill
    and the template's shots (``tasks/<template>.yaml``) for summarisation."""
    if setting == "protocol":
        return DEFAULT_PROTOCOL[task["kind"]]
    if task["kind"] == "generation":
        from h2o_eval.generation import template

        return template(task)["num_fewshot"]
    return 0


OmegaConf.register_new_resolver(
    "task_default", lambda setting, _root_: task_default(_root_.task, setting), replace=True
)
