"""Tasks scored by lm-eval in-process, with lm-eval's own task YAMLs: the paper's log-likelihood tasks
(``conf/task/<name>.yaml``) and, with ``task=lm_eval``, any task lm-eval knows or the user's own YAMLs
(``task.include_path``), log-likelihood and ``generate_until`` alike.

For each run we write a one-task YAML that ``include:``s the task's lm-eval YAML and, with ``data_dir``,
overrides only where the data comes from: ``dataset_path: json`` reading ``<data_dir>/<task>/<split>.jsonl``.
Prompts, choices and metrics stay lm-eval's. Locally only the evaluated split exists, so it becomes lm-eval's
``test_split`` and its few-shot pool; lm-eval then removes the scored document from its own few-shot draw.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from h2o_eval.errors import ConfigError

if TYPE_CHECKING:
    from h2o_eval.backend import Session


def task_registry() -> dict[str, dict[str, Any]]:
    """Every task name mapped to its config (the contents of ``conf/task/<name>.yaml``), as the CLI sees it."""
    folder = resources.files("h2o_eval.conf") / "task"
    return {
        entry.name.removesuffix(".yaml"): yaml.safe_load(entry.read_text())
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml")
    }


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
    if task["kind"] == "lm_eval":
        return Path(_entry(task).yaml_path)
    return lm_eval_tasks_dir() / task["lm_eval_yaml"]


def task_config(task: dict[str, Any]) -> dict[str, Any]:
    """The task's lm-eval config as lm-eval reads it (``include:`` resolved, ``!function`` left unresolved)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(source_yaml(task), resolve_func=False)


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
    if task["kind"] != "lm_eval" or not folder:
        return []
    return sorted(
        path
        for path in Path(folder).rglob("*")
        if path.suffix in (".yaml", ".yml", ".py") and "__pycache__" not in path.parts
    )


def local_data_file(task: dict[str, Any], data_dir: str | Path) -> Path:
    """Where the evaluated split is read from under ``data_dir``; fails early if it is not there."""
    path = Path(data_dir) / task["name"] / f"{evaluated_split(task)}.jsonl"
    if not path.is_file():
        raise ConfigError(f"no data file {path}: put it there or change data_dir={data_dir}")
    return path


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


def evaluate(
    model: Any,
    tokenizer: Any,
    task: dict[str, Any],
    session: Session,
    *,
    data_dir: str | Path | None,
    work_dir: Path,
    num_fewshot: int,
    limit: int | float | None,
    batch_size: int,
    seed: int,
    kernels: str = "auto",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Score ``model`` (patched: ``session`` is its backend session) on ``task`` with lm-eval, generating (for
    ``generate_until`` tasks) through an EvictionCache with ``kernels``.

    Returns lm-eval's results dict (with ``n-samples`` and the per-document ``samples``) and the realised
    capacities.
    """
    from lm_eval import simple_evaluate

    from h2o_eval.eviction_lm import EvictionLM

    manager = task_manager(task, data_dir, work_dir / "lm_eval_tasks")
    lm_task = manager.load([task["name"]])["tasks"][task["name"]]
    lm = EvictionLM(
        pretrained=model, tokenizer=tokenizer, batch_size=batch_size, session=session, kernels=kernels, task=lm_task
    )
    output = simple_evaluate(
        model=lm,
        tasks=[lm_task],
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=True,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return output, lm.capacity_stats()


def question_start(lm_task: Any, doc: dict[str, Any], prompt: str) -> int:
    """Where the scored document's own text starts in a request's prompt, after the demonstrations: the prompt
    ends with the task's ``doc_to_text`` of the document (or, for tasks with several inputs such as Winogrande,
    with one of its inputs)."""
    texts = lm_task.doc_to_choice(doc) if lm_task.multiple_input else [lm_task.doc_to_text(doc)]
    ends = [len(prompt) - len(text) for text in texts if isinstance(text, str) and text and prompt.endswith(text)]
    if not ends:
        raise ConfigError(
            f"protocol=context cannot find where task {lm_task.config.task}'s question starts in its prompt: "
            "use protocol=prefill"
        )
    return min(ends)


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


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
