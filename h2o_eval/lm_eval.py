"""lm-eval's own CLI, with the eviction backend as the model ``h2o_eval``.

    python -m h2o_eval.lm_eval --model h2o_eval \
        --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2,protocol=simulate --tasks copa,piqa \
        --data_dir ../shared/data

Every lm-eval option works as with ``lm_eval`` itself (``--include_path``, ``--num_fewshot``, ``--limit``,
``--output_path``, ``--log_samples`` ...). The model class is :class:`h2o_eval.eviction_lm.EvictionLM`, the one
``python -m h2o_eval`` scores with. lm-eval 0.4 discovers models only in its own registry (no plugin entry
point), so importing this module registers ``h2o_eval`` there; a plain ``lm_eval --model h2o_eval`` cannot see it.

``--model_args`` (with ``--batch_size`` and ``--device``) of ``--model h2o_eval`` are checked before anything loads,
as lm-eval will hand them to :meth:`~h2o_eval.eviction_lm.EvictionLM.from_settings`, and so is whether the policy can
score each of ``--tasks``: a bad one is a single line ``error: ...`` (exit status 2), not a traceback after the
weights load.

``--data_dir DIR`` (ours, not lm-eval's) reads each task's evaluated split from ``DIR/<task>/<split>.jsonl``
exactly as ``python -m h2o_eval data_dir=DIR`` does: a one-task YAML per task that ``include:``s lm-eval's and
points its data files there, handed to lm-eval as ``--include_path``. Without it a task whose hub data is neither
cached nor reachable is refused in one line naming ``--data_dir``, before the model loads.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model

from h2o_eval.errors import ConfigError, fail
from h2o_eval.eviction_lm import MODEL_NAME, EvictionLM, check_settings
from h2o_eval.policies import Policy

register_model(MODEL_NAME)(EvictionLM)


def _option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (None if absent), and ``argv`` without it."""
    rest, value, skip = [], None, False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == name:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value: {name} DIR")
            value, skip = argv[i + 1], True
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return value, rest


def model_settings(argv: list[str]) -> dict[str, Any] | None:
    """What lm-eval will create ``--model h2o_eval`` with: ``--model_args`` (``key=value`` pairs or JSON, parsed by
    lm-eval's own action), then ``--batch_size`` and ``--device`` (lm-eval's defaults when absent) over them, as
    lm-eval merges them. None for another model, or one named only in a ``--config`` YAML (checked when lm-eval
    creates it, still before its weights load)."""
    from lm_eval._cli.utils import MergeDictAction
    from lm_eval.config.evaluate_config import EvaluatorConfig

    parser = argparse.ArgumentParser(prog="python -m h2o_eval.lm_eval", add_help=False, allow_abbrev=False)
    parser.add_argument("--model", "-M")
    parser.add_argument("--model_args", "-a", nargs="+", action=MergeDictAction)
    parser.add_argument("--batch_size", "-b")
    parser.add_argument("--device")
    given = parser.parse_known_args(argv)[0]
    if given.model != MODEL_NAME:
        return None
    defaults = EvaluatorConfig()
    return {
        **(given.model_args or {}),
        "batch_size": given.batch_size or defaults.batch_size,
        "device": given.device or defaults.device,
    }


def check_model(argv: list[str]) -> Policy | None:
    """The policy ``--model h2o_eval`` will score with, every setting checked (:func:`check_settings`) before any
    model loads; None for another model."""
    settings = model_settings(argv)
    return None if settings is None else check_settings(**settings)[0]


def local_tasks(argv: list[str], folder: Path, policy: Policy | None = None) -> list[str]:
    """``argv`` for lm-eval: with ``--data_dir``, a local-data YAML per task of ``--tasks`` written to ``folder`` and
    passed as ``--include_path``; without it, each task's hub data checked (cached or reachable). With the
    ``policy`` of ``--model h2o_eval``, each task must be one it can score. Bad input is a one-line
    :class:`ConfigError`."""
    from h2o_eval import hub
    from h2o_eval.runners import lmeval, task_registry

    data_dir, argv = _option(argv, "--data_dir")
    names, _ = _option(argv, "--tasks")
    if not names:
        return argv
    known, include = task_registry(), _option(argv, "--include_path")[0]
    tasks = [
        known.get(name) or {"name": name, "runner": "lm_eval", "include_path": include} for name in names.split(",")
    ]
    if policy is not None:
        for task in tasks:
            if (reason := lmeval.RUNNER.refusal(task, policy)) is not None:
                raise ConfigError(f"policy={policy.name} {reason} (task {task['name']})")
    if data_dir is None:
        for task in tasks:
            if (dataset := lmeval.hub_dataset(task)) is not None:
                hub.check_dataset(task["name"], dataset, option="--data_dir")
        return argv
    if include is not None:
        raise ConfigError("--data_dir writes the tasks' own include path: give --data_dir or --include_path, not both")
    folder.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        (folder / f"{task['name']}.yaml").write_text(yaml.safe_dump(lmeval.task_yaml(task, data_dir), sort_keys=False))
    return [*argv, "--include_path", str(folder)]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="h2o_eval-tasks-") as folder:
        try:
            policy = check_model(sys.argv[1:])
            sys.argv[1:] = local_tasks(sys.argv[1:], Path(folder), policy)
            cli_evaluate()
        except ConfigError as error:
            fail(error)


if __name__ == "__main__":
    main()
