"""The settings a run can be refused for without torch, transformers or lm-eval: checked first, so that such a
refusal prints within a second; what needs them (a policy's own parameters, the task's data, the model, the device)
is checked after, by :func:`h2o_eval.run.validate`."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from h2o_eval.errors import ConfigError

# How a fraction budget b of a length L becomes C: up = ceil(b * L) (the default: C never falls short of the
# budget), down = int(b * L) (kvpress's int(L * (1 - compression_ratio))); C is at least 1 either way.
ROUNDINGS = ("up", "down")
WANDB_MODES = ("offline", "online", "disabled")
ON_ERROR = ("stop", "skip")  # a sweep's or grid's invalid jobs: stop before anything runs, or run the others


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def budget_value(text: str) -> float | int:
    """A budget as a command line's argument reads one: an integer is a number of tokens, a decimal a fraction (1.0:
    everything)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: use a fraction in (0, 1] or a number of tokens") from None


def check_budget(budget: Any, rounding: Any) -> None:
    """A policy's budget (a fraction in (0, 1], or a token count >= 1) and ``rounding`` (:data:`ROUNDINGS`)."""
    if not (is_int(budget) and budget >= 1) and not (isinstance(budget, float) and 0 < budget <= 1):
        raise ConfigError(
            f"budget={budget!r}: use a fraction in (0, 1] such as 0.2, or a token count >= 1 (1 is one token; "
            "1.0 the whole cache)"
        )
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding={rounding!r}: use one of {', '.join(ROUNDINGS)}")


def check_settings(config: Mapping[str, Any]) -> None:
    """Every top-level setting of a run's config (the Hydra config as a plain dict) that is checked by its value
    alone: the budget (but the full cache's, which it ignores) and rounding, ``limit``, ``num_fewshot``,
    ``batch_size``, ``stack_cells``, ``graphs``, ``seed``, ``threads``, ``on_error`` and ``wandb``."""
    if config["policy"]["name"] != "full":
        check_budget(config["budget"], config["rounding"])
    limit = config["limit"]
    if limit is not None and not (is_int(limit) and limit >= 1) and not (isinstance(limit, float) and 0 < limit < 1):
        raise ConfigError(f"limit={limit!r}: use a document count >= 1, a fraction in (0, 1), or null for all")
    num_fewshot = config["num_fewshot"]
    if num_fewshot is not None and (not is_int(num_fewshot) or num_fewshot < 0):
        raise ConfigError(f"num_fewshot={num_fewshot!r}: use an integer >= 0")
    if not is_int(config["batch_size"]) or config["batch_size"] < 1:
        raise ConfigError(f"batch_size={config['batch_size']!r}: use an integer >= 1")
    if not isinstance(config["stack_cells"], bool):
        raise ConfigError(f"stack_cells={config['stack_cells']!r}: use true or false")
    if config["graphs"] not in (True, False, "emulate"):
        raise ConfigError(f"graphs={config['graphs']!r}: use true, false or emulate")
    if config["graphs"] == "emulate" and config["kernels"] == "triton":
        raise ConfigError("graphs=emulate replays aten operations, which Triton's kernels are not: use kernels=torch")
    if not is_int(config["seed"]):
        raise ConfigError(f"seed={config['seed']!r}: use an integer")
    threads = config["threads"]
    if threads is not None and (not is_int(threads) or threads < 1):
        raise ConfigError(f"threads={threads!r}: use an integer >= 1, or null for the cores this job may use")
    if config["on_error"] not in ON_ERROR:
        raise ConfigError(f"on_error={config['on_error']!r}: use one of {', '.join(ON_ERROR)}")
    if config["wandb"]["mode"] not in WANDB_MODES:
        raise ConfigError(f"wandb.mode={config['wandb']['mode']!r}: use one of {', '.join(WANDB_MODES)}")
    timeout = config["wandb"]["init_timeout"]
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise ConfigError(f"wandb.init_timeout={timeout!r}: use a number of seconds > 0")
