"""h2o_eval's Hydra configs. Importing the package (Hydra does, to read them) registers the resolver that
``config.yaml`` uses for task-dependent defaults, so ``--cfg job`` shows the values a run will use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

DEFAULT_PROTOCOL = {"loglikelihood": "simulate", "generation": "prefill", "synthetic": "prefill"}


def task_default(task: Mapping[str, Any], setting: str) -> Any:
    """``protocol`` or ``num_fewshot`` when not given: simulate and 0 shots for log-likelihood tasks; prefill
    and the template's shots (``tasks/<template>.yaml``) for summarisation; for ``task=lm_eval``, by the task's
    requests (prefill for ``generate_until``, else simulate) and its YAML's ``num_fewshot`` (0 if none)."""
    if task["kind"] == "lm_eval":
        from h2o_eval import harness

        if setting == "protocol":
            return "prefill" if harness.output_type(dict(task)) == "generate_until" else "simulate"
        return harness.task_config(dict(task)).get("num_fewshot") or 0
    if setting == "protocol":
        return DEFAULT_PROTOCOL[task["kind"]]
    if task["kind"] == "generation":
        from h2o_eval.generation import template

        return template(task)["num_fewshot"]
    return 0


OmegaConf.register_new_resolver(
    "task_default", lambda setting, _root_: task_default(_root_.task, setting), replace=True
)
