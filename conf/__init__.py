"""h2o_eval's Hydra configs. Importing the package (Hydra does, to read them) registers the resolver that
``config.yaml`` uses for task-dependent defaults, so ``--cfg job`` shows the values a run will use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf


def task_default(task: Mapping[str, Any], setting: str) -> Any:
    """``protocol`` or ``num_fewshot`` when not given: what the task's runner says (simulate and 0 shots for
    log-likelihood tasks; prefill, and the template's or the lm-eval YAML's shots, for generation)."""
    from h2o_eval.runners import runner_of

    runner = runner_of(task)
    return runner.default_protocol(task) if setting == "protocol" else runner.default_fewshot(task)


OmegaConf.register_new_resolver(
    "task_default", lambda setting, _root_: task_default(dict(_root_.task), setting), replace=True
)
