"""Log-likelihood tasks scored by lm-eval in-process, with lm-eval's own task YAMLs.

For each run we write a one-task YAML that ``include:``s the installed lm-eval YAML and, with ``data_dir``,
overrides only where the data comes from: ``dataset_path: json`` reading ``<data_dir>/<task>/<split>.jsonl``.
Prompts, choices and metrics stay lm-eval's. Locally only the evaluated split exists, so it becomes lm-eval's
``test_split`` and its few-shot pool; lm-eval then removes the scored document from its own few-shot draw.
"""

from __future__ import annotations

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


def evaluated_split(task: dict[str, Any]) -> str:
    """The split lm-eval scores for this task: its ``test_split``, else its ``validation_split``."""
    source = lm_eval_tasks_dir() / task["lm_eval_yaml"]
    config = yaml.load(source.read_text(), Loader=_IgnoreTagsLoader)
    split = config.get("test_split") or config.get("validation_split")
    if not split:
        raise ConfigError(f"{source} names no test or validation split: pick another task")
    return split


def hub_dataset(task: dict[str, Any]) -> str:
    """The hub dataset lm-eval loads for this task without ``data_dir`` (its YAML's ``dataset_path``)."""
    source = lm_eval_tasks_dir() / task["lm_eval_yaml"]
    config = yaml.load(source.read_text(), Loader=_IgnoreTagsLoader)
    if "dataset_path" not in config and "include" in config:
        config = yaml.load((source.parent / config["include"]).read_text(), Loader=_IgnoreTagsLoader)
    return config["dataset_path"]


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
        "include": str(lm_eval_tasks_dir() / task["lm_eval_yaml"]),
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
) -> dict[str, Any]:
    """Score ``model`` (patched: ``session`` is its backend session) on ``task`` with lm-eval.

    Returns lm-eval's results dict (with ``n-samples`` and the per-document ``samples``).
    """
    from lm_eval import simple_evaluate

    manager = task_manager(task, data_dir, work_dir / "lm_eval_tasks")
    lm_task = manager.load([task["name"]])["tasks"][task["name"]]
    lm = eviction_lm(model, tokenizer, session, batch_size, lm_task)
    return simple_evaluate(
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


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def eviction_lm(model: Any, tokenizer: Any, session: Session, batch_size: int, lm_task: Any = None) -> Any:
    """lm-eval's HFLM, telling the backend each padded row's real length and context length.

    HFLM right-pads a batch and calls the model without a mask. Per-sequence budgets need each row's length
    (simulate: the request, context + continuation minus its last token) and where its context ends: for
    ``prefill`` the whole prompt, for ``context`` the demonstrations before the scored document's own text
    (found with ``lm_task``). Both are looked up from the requests HFLM is about to score.
    """
    import torch
    from lm_eval.models.huggingface import HFLM

    class EvictionLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm=False):
            if session.protocol == "context":
                self.question_starts = {
                    request.args[0]: question_start(lm_task, request.doc, request.args[0]) for request in requests
                }
            return super().loglikelihood(requests, disable_tqdm)

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
            self.context_lengths: dict[tuple[int, ...], int] = {}
            for (prompt, _), context, continuation in requests:
                fed = (context + continuation)[-(self.max_length + 1) :][:-1]
                if session.protocol == "context":
                    demonstrations = self.tok_encode(prompt[: self.question_starts[prompt]])
                    cut = len(context) + len(continuation) - 1 - len(fed)  # tokens lost to left truncation
                    self.context_lengths[tuple(fed)] = max(0, _common_prefix(demonstrations, context) - cut)
                else:
                    self.context_lengths[tuple(fed)] = max(1, len(fed) - len(continuation) + 1)
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)

        def _model_call(self, inps, attn_mask=None, labels=None):
            lengths, contexts = zip(*(self._lookup(row) for row in inps.tolist()), strict=True)
            mask = torch.arange(inps.shape[1], device=inps.device) < torch.tensor(lengths, device=inps.device)[:, None]
            session.context_lengths = list(contexts)
            with (
                torch.no_grad(),
                torch.autocast(
                    device_type=self.device.type,
                    dtype=self.mixed_precision_dtype,
                    enabled=self.mixed_precision_dtype is not None,
                ),
            ):
                return self.model(inps, attention_mask=mask.long()).logits

        def _lookup(self, row: list[int]) -> tuple[int, int]:
            for length in range(len(row), 0, -1):
                if (context := self.context_lengths.get(tuple(row[:length]))) is not None:
                    return length, context
                if row[length - 1] != 0:  # lm-eval pads with 0: a real token ends the search
                    break
            raise RuntimeError("a batch row matches no request being scored: lm-eval's batching changed")

    return EvictionLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def metrics(results: dict[str, Any], task_name: str) -> dict[str, float]:
    """lm-eval's metrics for one task without the filter suffix: ``acc``, ``acc_stderr``, ``acc_norm`` ..."""
    return {
        key.split(",")[0]: value
        for key, value in results["results"][task_name].items()
        if "," in key and isinstance(value, int | float)
    }


def document_scores(results: dict[str, Any], task_name: str) -> list[dict[str, Any]]:
    """One row per scored document of ``task_name`` from lm-eval's logged samples: its ``id`` (lm-eval's
    ``doc_id``), ``target`` and ``scores`` (each metric of the task's ``metric_list`` for that document)."""
    names = {key.split(",")[0] for key in results["results"][task_name] if "," in key}
    return [
        {
            "id": sample["doc_id"],
            "target": sample["target"],
            "scores": {name: float(sample[name]) for name in sorted(names) if name in sample},
        }
        for sample in sorted(results["samples"][task_name], key=lambda sample: sample["doc_id"])
    ]


class _IgnoreTagsLoader(yaml.SafeLoader):
    """Reads lm-eval YAMLs for their plain keys, leaving ``!function`` tags unresolved."""


_IgnoreTagsLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
