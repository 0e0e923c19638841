"""The ``lm_eval`` runner: tasks scored by lm-eval in-process, with lm-eval's own task YAMLs: the paper's
log-likelihood tasks (``conf/task/<name>.yaml`` naming ``lm_eval_yaml``) and, with ``task=lm_eval``, any task lm-eval
knows or the user's own YAMLs (``task.include_path``), log-likelihood and ``generate_until`` alike.

For each run we write a one-task YAML that ``include:``s the task's lm-eval YAML and, with ``data_dir``,
overrides only where the data comes from: ``dataset_path: json`` reading ``<data_dir>/<task>/<split>.jsonl``.
Prompts, choices and metrics stay lm-eval's. Locally only the evaluated split exists, so it becomes lm-eval's
``test_split`` and its few-shot pool; lm-eval then removes the scored document from its own few-shot draw.
The model is :class:`~h2o_eval.eviction_lm.EvictionLM` under :func:`~h2o_eval.backend.patch`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from h2o_eval import hub
from h2o_eval.data import read_jsonl, split_file
from h2o_eval.errors import ConfigError
from h2o_eval.runners import Evaluation, Runner, task_registry


def lm_eval_tasks_dir() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks"


@functools.lru_cache(maxsize=4)
def _index(include_path: str | None) -> dict[str, Any]:
    """lm-eval's task index: of ``include_path`` alone, or of lm-eval's own tasks (None); built once per process."""
    from lm_eval.tasks import TaskManager

    if include_path is None:
        return TaskManager().task_index
    return TaskManager(include_path=include_path, include_defaults=False).task_index


def _entry(task: dict[str, Any]) -> Any:
    """lm-eval's index entry of a ``task=lm_eval`` task: found under ``task.include_path`` first, then among
    lm-eval's own tasks."""
    from lm_eval.tasks._index import Kind

    name, include_path = task["name"], task.get("include_path")
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"task.include_path={include_path} is not a folder: give the folder of your task YAMLs")
    entry = (_index(include_path).get(name) if include_path else None) or _index(None).get(name)
    if entry is None:
        where = f"neither under {include_path} nor" if include_path else "not"
        raise ConfigError(f"task.name={name} is {where} among lm-eval's tasks: check it (`lm-eval ls tasks`)")
    if entry.kind not in (Kind.TASK, Kind.PY_TASK) or entry.yaml_path is None:
        raise ConfigError(
            f"task.name={name} is an lm-eval {entry.kind.name.lower()} of several tasks: name its tasks, e.g. "
            "--multirun task.name=a,b"
        )
    return entry


def source_yaml(task: dict[str, Any]) -> Path:
    """The lm-eval YAML that defines ``task``: one of lm-eval's own, or the user's (``task.include_path``)."""
    if task.get("lm_eval_yaml"):
        return lm_eval_tasks_dir() / task["lm_eval_yaml"]
    return Path(_entry(task).yaml_path)


def task_config(task: Mapping[str, Any]) -> dict[str, Any]:
    """The task's lm-eval config as lm-eval reads it (``include:`` resolved, ``!function`` left unresolved)."""
    return _yaml_loader().load_yaml(source_yaml(task), resolve_func=False)


@functools.cache
def _yaml_loader() -> Any:
    """lm-eval's YAML loader (``lm_eval/tasks/_yaml_loader.py``, which imports yaml alone), loaded from its file:
    importing it as ``lm_eval.tasks._yaml_loader`` would import ``lm_eval.tasks`` first, its task index with
    datasets and pandas (over a second), before a setting could be refused."""
    spec = importlib.util.spec_from_file_location(
        "h2o_eval_lm_eval_yaml_loader", lm_eval_tasks_dir() / "_yaml_loader.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def output_type(task: dict[str, Any]) -> str:
    """lm-eval's request type for the task: ``multiple_choice``, ``loglikelihood``, ``generate_until`` ..."""
    return task_config(task).get("output_type", "generate_until")


def primary_metric(task: dict[str, Any]) -> str:
    """The record's headline metric: ``task.metric`` if set, else the first of the task's ``metric_list``, with
    the first filter's name when the task filters its outputs (as lm-eval keys its results)."""
    config = task_config(task)
    names = [m["metric"] for m in config.get("metric_list", [])] or ["acc"]
    chosen = task.get("metric") or names[0]
    if chosen not in names:
        raise ConfigError(f"task.metric={chosen}: task {task['name']} reports {', '.join(names)}; pick one of them")
    filters = [f["name"] for f in config.get("filter_list", [])]
    return chosen if not filters or filters[0] == "none" else f"{chosen},{filters[0]}"


def evaluated_split(task: dict[str, Any]) -> str:
    """The split lm-eval scores for this task: its ``test_split``, else its ``validation_split``."""
    config = task_config(task)
    split = config.get("test_split") or config.get("validation_split")
    if not split:
        raise ConfigError(f"{source_yaml(task)} names no test or validation split: pick another task")
    return split


def named_data_files(task: dict[str, Any]) -> list[Path]:
    """The local files a task's own YAML reads (its ``dataset_kwargs.data_files``), as paths from the working
    folder."""
    files = task_config(task).get("dataset_kwargs", {}).get("data_files") or []
    values = files.values() if isinstance(files, dict) else [files]
    return [Path(name) for value in values for name in ([value] if isinstance(value, str) else value)]


def hub_dataset(task: dict[str, Any]) -> str | None:
    """The hub dataset lm-eval loads for this task without ``data_dir`` (its YAML's ``dataset_path``), or None
    when its YAML reads local files."""
    return None if named_data_files(task) else task_config(task)["dataset_path"]


def task_files(task: dict[str, Any]) -> list[Path]:
    """The user's task files a ``task=lm_eval`` task's results depend on: the YAMLs and Python helpers under
    ``task.include_path`` (none for lm-eval's own tasks, which lm-eval's version pins)."""
    folder = task.get("include_path")
    if not folder:
        return []
    return sorted(
        path
        for path in Path(folder).rglob("*")
        if path.suffix in (".yaml", ".yml", ".py") and "__pycache__" not in path.parts
    )


def local_data_file(task: dict[str, Any], data_dir: str | Path) -> Path:
    """Where the evaluated split is read from under ``data_dir``; fails early if it is not there."""
    return split_file(data_dir, task["name"], evaluated_split(task))


def task_yaml(task: dict[str, Any], data_dir: str | Path | None) -> dict[str, Any]:
    """The lm-eval task config for one run: lm-eval's YAML, plus local data files when ``data_dir`` is set."""
    config: dict[str, Any] = {
        "task": task["name"],
        "include": str(source_yaml(task)),
    }
    if data_dir is not None:
        split = evaluated_split(task)
        config |= {
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(local_data_file(task, data_dir).resolve())}},
            "training_split": None,
            "validation_split": None,
            "test_split": split,
            "fewshot_split": split,
        }
    return config


def task_manager(task: dict[str, Any], data_dir: str | Path | None, task_dir: Path) -> Any:
    """An lm-eval ``TaskManager`` that knows only ``task``: its one-task YAML (see :func:`task_yaml`) is
    written to ``task_dir``, which is all the manager indexes."""
    from lm_eval.tasks import TaskManager

    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / f"{task['name']}.yaml").write_text(yaml.safe_dump(task_yaml(task, data_dir), sort_keys=False))
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def metrics(results: dict[str, Any], task_name: str) -> dict[str, float]:
    """lm-eval's metrics for one task: ``acc``, ``acc_stderr``, ``acc_norm`` ...; a metric of a filter other
    than ``none`` keeps lm-eval's key (``exact_match,strict-match``)."""
    return {
        key.removesuffix(",none"): value
        for key, value in results["results"][task_name].items()
        if "," in key and isinstance(value, int | float)
    }


def document_scores(results: dict[str, Any], task_name: str) -> list[dict[str, Any]]:
    """One row per scored document of ``task_name`` from lm-eval's logged samples: its ``id`` (lm-eval's
    ``doc_id``), ``target`` and ``scores``: that document's value of every metric :func:`metrics` reports, under
    the same name, where it is a number (a corpus-level metric such as ``brier_score`` or F1 keeps per-document
    tuples for its aggregation, which are not scores)."""
    names = [key.split(",", 1) for key in metrics(results, task_name) if not key.split(",")[0].endswith("_stderr")]
    rows: dict[int, dict[str, Any]] = {}
    for sample in results["samples"][task_name]:
        row = rows.setdefault(sample["doc_id"], {"id": sample["doc_id"], "target": sample["target"], "scores": {}})
        for metric, *kept in names:
            if sample.get("filter", "none") == (kept or ["none"])[0] and isinstance(sample.get(metric), int | float):
                row["scores"][",".join([metric, *kept])] = float(sample[metric])
    return [rows[doc_id] for doc_id in sorted(rows)]


class LmEvalRunner(Runner):
    """lm-eval's tasks, scored by lm-eval on :class:`~h2o_eval.eviction_lm.EvictionLM`."""

    name = "lm_eval"
    optional = ("metric",)  # the record's headline metric, for any lm-eval task

    def settings(self, task: Mapping[str, Any]) -> set[str]:
        """A task named by ``task=lm_eval`` (no ``lm_eval_yaml``) takes the settings of ``conf/task/lm_eval.yaml``
        (``include_path``, ``metric``), whatever its name; one of ``conf/task/`` those of its own config."""
        if task.get("lm_eval_yaml") is None:
            return set(task_registry()["lm_eval"]) | set(self.optional)
        return super().settings(task)

    def default_protocol(self, task: Mapping[str, Any]) -> str:
        return "prefill" if self.generates(task) else "simulate"

    def default_fewshot(self, task: Mapping[str, Any]) -> int:
        """The task YAML's ``num_fewshot``, else 0."""
        return task_config(dict(task)).get("num_fewshot") or 0

    def generates(self, task: Mapping[str, Any]) -> bool:
        return output_type(dict(task)) == "generate_until"

    def refusal(self, task: Mapping[str, Any], policy: Any) -> str | None:
        if self.generates(task) and policy.needs_answer:
            return "needs each request's full-cache answer, which lm-eval's generate_until requests do not give it"
        return super().refusal(task, policy)

    def check(self, config: Mapping[str, Any]) -> None:
        task = dict(config["task"])
        primary_metric(task)
        if config["protocol"] == "context" and not self.generates(task) and config["num_fewshot"] == 0:
            raise ConfigError(
                "protocol=context compresses a log-likelihood request's demonstrations before its question: "
                "use num_fewshot >= 1"
            )
        for path in self.data_files(task, config["data_dir"]):
            if path.suffix == ".jsonl":
                read_jsonl(path)
        if config["data_dir"] is None and (dataset := hub_dataset(task)) is not None:
            hub.check_dataset(task["name"], dataset)

    def data_files(self, task: Mapping[str, Any], data_dir: str | Path | None) -> list[Path]:
        """The user's task files (``task.include_path``) and, with ``data_dir``, the evaluated split's JSONL; without
        it, the local files a user's task YAML names (a hub task reads none)."""
        task = dict(task)
        own = task_files(task)
        if data_dir is None:
            return own + [_existing(path, task) for path in named_data_files(task)] if own else []
        return [*own, local_data_file(task, data_dir)]

    def evaluate(self, model: Any, tokenizer: Any, policy: Any, config: Mapping[str, Any]) -> Evaluation:
        """Score the task with lm-eval's ``simple_evaluate`` under ``patch`` (``generate_until`` requests generate
        through an EvictionCache); the record gets lm-eval's metrics, its per-document scores and its table."""
        from lm_eval import simple_evaluate
        from lm_eval.utils import make_table

        from h2o_eval.backend import patch
        from h2o_eval.eviction_lm import EvictionLM
        from h2o_eval.policies import configured_interval

        task = dict(config["task"])
        with tempfile.TemporaryDirectory(prefix="h2o_eval-lm_eval-") as folder:
            manager = task_manager(task, config["data_dir"], Path(folder))
            lm_task = manager.load([task["name"]])["tasks"][task["name"]]
        interval = configured_interval(config, policy)
        with (
            patch(model, policy, config["protocol"], config["kernels"], config["decoding"], interval) as session,
            quiet_git_hash(),
        ):
            lm = EvictionLM(
                pretrained=model,
                tokenizer=tokenizer,
                batch_size=config["batch_size"],
                session=session,
                kernels=config["kernels"],
                graphs=config["graphs"],
                task=lm_task,
            )
            seed = config["seed"]
            output = simple_evaluate(
                model=lm,
                tasks=[lm_task],
                num_fewshot=config["num_fewshot"],
                limit=config["limit"],
                task_manager=manager,
                log_samples=True,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
        name = task["name"]
        fields = {
            "metric": primary_metric(task),
            "metrics": metrics(output, name),
            "n_samples": output["n-samples"][name]["effective"],
            "output_type": output_type(task),
            **lm.record_fields(),
        }
        return Evaluation(fields, document_scores(output, name), make_table(output))


@contextlib.contextmanager
def quiet_git_hash() -> Iterator[None]:
    """lm-eval's results name the commit of the working folder (``git describe``, its error printed outside a
    checkout: ``fatal: not a git repository``); inside the block they take it the way lm-eval falls back to, by
    reading ``.git`` without a subprocess. The record's own ``git`` is h2o_eval's (:func:`results.git_commit`)."""
    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: get_commit_from_path(os.getcwd())):
        yield


def _existing(path: Path, task: dict[str, Any]) -> Path:
    if not path.is_file():
        raise ConfigError(f"task {task['name']} reads {path}, which does not exist: fix its YAML's data_files")
    return path


RUNNER = LmEvalRunner()
