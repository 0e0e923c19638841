"""Task runners: one per task family, each implementing :class:`Runner`, chosen by the task config's ``runner``.

Nothing outside a runner branches on what kind of task runs: the CLI's validation, the task-dependent defaults of
``conf/config.yaml``, the record's identity and data fingerprint, and the grid ask the runner.

- ``lm_eval`` (:mod:`h2o_eval.runners.lmeval`): any lm-eval task, log-likelihood or ``generate_until``, with
  lm-eval's own YAMLs (the paper's six tasks, or ``task=lm_eval task.name=...``);
- ``summarisation`` (:mod:`h2o_eval.runners.summarisation`): XSUM and CNN/DM with HELM-style prompts
  (``tasks/<template>.yaml``), scored with ROUGE;
- ``long_context`` (:mod:`h2o_eval.runners.long_context`): the synthetic RULER-style tasks;
- ``reasoning`` (:mod:`h2o_eval.runners.reasoning`): MATH-500, AIME and GSM8K, a long answer per problem.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar

from h2o_eval.conf import options
from h2o_eval.errors import ConfigError

# Runner name (a task config's ``runner``) -> the module defining it as ``RUNNER``; imported on first use, so that
# asking a task's defaults never loads lm-eval or torch.
RUNNERS = {
    "lm_eval": "h2o_eval.runners.lmeval",
    "summarisation": "h2o_eval.runners.summarisation",
    "long_context": "h2o_eval.runners.long_context",
    "reasoning": "h2o_eval.runners.reasoning",
}


@dataclass
class Evaluation:
    """What a runner's evaluation gives the record: its ``fields`` (``metrics``, ``n_samples``, ``capacity``, and
    what the family adds), the per-document ``outputs`` (each row with its ``id`` and ``scores``), and a table to
    print (lm-eval's), if any."""

    fields: dict[str, Any]
    outputs: list[dict[str, Any]]
    table: str | None = None


class Runner:
    """A task family: its settings and their validation, the data it reads, its defaults, and its evaluation."""

    name: ClassVar[str]
    # Task settings the runner reads that a task's own config may leave out.
    optional: ClassVar[tuple[str, ...]] = ()
    # The ``generation.<key>`` settings it reads (:func:`check_generation_keys` refuses the others when set).
    generation: ClassVar[tuple[str, ...]] = ()

    def settings(self, task: Mapping[str, Any]) -> set[str]:
        """The task settings (``task.<key>``) this runner reads for ``task``: the keys of its own config
        (``conf/task/<name>.yaml``) and the runner's :attr:`optional` ones; a task that is not in ``conf/task/``
        may take any key of its runner's tasks."""
        registry = task_registry()
        own = registry.get(task["name"])
        if own is not None and own.get("runner") == self.name:
            keys = set(own)
        else:
            keys = {key for config in registry.values() if config.get("runner") == self.name for key in config}
        return keys | set(self.optional)

    def default_protocol(self, task: Mapping[str, Any]) -> str:
        """The protocol when none is given: ``simulate`` for log-likelihood tasks, ``prefill`` for generation."""
        raise NotImplementedError

    def default_fewshot(self, task: Mapping[str, Any]) -> int:
        return 0

    def generates(self, task: Mapping[str, Any]) -> bool:
        """Whether the task generates text (and so needs a policy that runs as a cache)."""
        return True

    def check(self, config: Mapping[str, Any]) -> None:
        """Every task setting and data file, refused with one line naming the fix, before any model loads."""

    def refusal(self, task: Mapping[str, Any], policy: Any) -> str | None:
        """Why this task cannot run ``policy`` (None: it can). A task that generates can run every policy with a
        cache, those that score their prompt by extra passes included; one scored in a single forward per request
        (log-likelihood) cannot run extra passes, nor re-rotate its prompt's keys before what follows."""
        if self.generates(task):
            return None if policy.has_cache else "is a simulation of scoring only: generate with policy=h2o"
        if policy.rehearses:
            return (
                "scores its prompt by extra passes, which a log-likelihood request's single forward cannot run: use "
                "it on a generation task"
            )
        if policy.rerotates:
            return (
                "re-rotates the keys its prompt kept, which a log-likelihood request's single forward (prompt and "
                "continuation together) cannot do: use it on a generation task, or without re-rotation "
                "(finch: policy.rerotate_keys=false; key_rerotation: its base alone)"
            )
        return None

    def data_files(self, task: Mapping[str, Any], data_dir: str | Path | None) -> list[Path]:
        """The local files whose content the results depend on (the record's identity hashes them); none when
        the data comes from the hub. Each must exist."""
        return []

    def identity(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Settings outside the task group that change this family's numbers (summarisation's ``generation``)."""
        return {}

    def evaluate(self, model: Any, tokenizer: Any, policy: Any, config: Mapping[str, Any]) -> Evaluation:
        raise NotImplementedError

    def reference(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """The settings of the run whose outputs this run's are set beside (the reasoning runner: the full cache's),
        or None (the default): the run hands that run's stored outputs to :meth:`compare`."""
        return None

    def compare(
        self, model: Any, tokenizer: Any, config: Mapping[str, Any], evaluation: Evaluation, stored: list[dict] | None
    ) -> None:
        """Set ``evaluation`` beside its :meth:`reference` run's outputs (``stored``: its record's, None where there
        is none), into its fields and outputs."""

    def shares_prompts(self, config: Mapping[str, Any]) -> bool:
        """Whether cells that differ only in policy, budget (or threshold) and protocol can share their prompt pass
        (:meth:`evaluate_shared`)."""
        return False

    def evaluate_shared(
        self, model: Any, tokenizer: Any, cells: Sequence[tuple[Any, Mapping[str, Any]]], partial: Any = None
    ) -> list[Evaluation]:
        """:meth:`evaluate` of several (policy, config) cells at once; by default one after the other. ``partial``
        (:class:`~h2o_eval.generation.partial.Partial`): where a runner that answers through
        :func:`h2o_eval.generation.answer` (RULER's) keeps its answers so far, and resumes from."""
        return [self.evaluate(model, tokenizer, policy, config) for policy, config in cells]


def runner_of(task: Mapping[str, Any]) -> Runner:
    """The runner a task config names (``runner``)."""
    name = task.get("runner")
    if name not in RUNNERS:
        raise ConfigError(f"task.runner={name!r}: use one of {', '.join(RUNNERS)}")
    return import_module(RUNNERS[name]).RUNNER


def check_task_keys(task: Mapping[str, Any]) -> None:
    """Refuse a task setting its runner does not read (``task.lenght``, or a key of another family's tasks), which
    would otherwise be stored in the record and change nothing else."""
    valid = runner_of(task).settings(task)
    unknown = sorted(set(task) - valid)
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], valid, n=1)
    hint = f" (task.{close[0]}?)" if close else ""
    raise ConfigError(
        f"task {task['name']} takes no {', '.join(unknown)}{hint}: its settings are {', '.join(sorted(valid))}"
    )


# A ``generation`` setting at this value asks for nothing: the task's own length, greedy decoding, one solution.
UNSET = {"max_new_tokens": None, "max_words": None, "sample": False, "samples": 1}


def check_generation_keys(config: Mapping[str, Any]) -> None:
    """Refuse a ``generation`` setting that asks for something (:data:`UNSET`) of a task whose runner does not read
    it (``task=gsm8k generation.max_new_tokens=0``), which would otherwise be stored in the record and change
    nothing else."""
    runner = runner_of(config["task"])
    for key, unset in UNSET.items():
        value = config["generation"].get(key, unset)
        if value == unset or key in runner.generation:
            continue
        own = f"task.{key}" if key in runner.settings(config["task"]) else None
        fix = f"set {own} instead" if own else f"drop it (the {runner.name} runner reads no generation.{key})"
        raise ConfigError(f"task {config['task']['name']} does not read generation.{key}={value!r}: {fix}")


def task_registry() -> dict[str, dict[str, Any]]:
    """Every task name mapped to its config (the contents of ``conf/task/<name>.yaml``), as the CLI sees it."""
    return options("task")
