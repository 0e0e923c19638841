"""lm-eval's own CLI, with the eviction backend as the model ``h2o_eval``.

    python -m h2o_eval.lm_eval --model h2o_eval \
        --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2,protocol=simulate --tasks copa,piqa \
        --data_dir ../shared/data

Every lm-eval option works as with ``lm_eval`` itself (``--include_path``, ``--num_fewshot``, ``--limit``,
``--output_path``, ``--log_samples`` ...). The model class is :class:`h2o_eval.eviction_lm.EvictionLM`, the one
``python -m h2o_eval`` scores with. lm-eval 0.4 discovers models only in its own registry (no plugin entry
point), so importing this module registers ``h2o_eval`` there; a plain ``lm_eval --model h2o_eval`` cannot see it.

``--data_dir DIR`` (ours, not lm-eval's) reads each task's evaluated split from ``DIR/<task>/<split>.jsonl``
exactly as ``python -m h2o_eval data_dir=DIR`` does: a one-task YAML per task that ``include:``s lm-eval's and
points its data files there, handed to lm-eval as ``--include_path``. Without it a task whose hub data is neither
cached nor reachable is refused in one line naming ``--data_dir``, before the model loads.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model

from h2o_eval.errors import ConfigError
from h2o_eval.eviction_lm import MODEL_NAME, EvictionLM
from h2o_eval.run import fail

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


def local_tasks(argv: list[str], folder: Path) -> list[str]:
    """``argv`` for lm-eval: with ``--data_dir``, a local-data YAML per task of ``--tasks`` written to ``folder`` and
    passed as ``--include_path``; without it, each task's hub data checked (cached or reachable). Bad input is a
    one-line :class:`ConfigError`."""
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
            sys.argv[1:] = local_tasks(sys.argv[1:], Path(folder))
            cli_evaluate()
        except ConfigError as error:
            fail(error)


if __name__ == "__main__":
    main()
