"""Every setting of a RULER task, and its data, checked before any model loads; each refused in one line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from h2o_eval.errors import ConfigError
from h2o_eval.ruler.sources import DATASETS, data_files, qa_data
from h2o_eval.ruler.tasks import DEPTHS, FAMILIES, FIT_TOKENIZERS, HAYSTACKS, METRICS, NEEDLE_TYPES, PARAMETERS


def check(task: Mapping[str, Any], data_dir: str | Path | None, documents: int | None = None) -> None:
    """Every setting of the task, and its data, checked before any model loads; each refused in one line.
    ``documents``: how many of the task's documents the run asks (the first ones; None: ``task.samples``)."""
    family = task.get("family")
    if family not in FAMILIES:
        raise ConfigError(f"task.family={family!r}: use one of {', '.join(FAMILIES)}")
    _integer(task, "length", 1)
    _integer(task, "max_new_tokens", 1)
    if task["length"] <= task["max_new_tokens"]:
        raise ConfigError(
            f"task.length={task['length']} leaves no room for the input: use task.length > max_new_tokens"
        )
    _integer(task, "seed", 0)
    _integer(task, "samples", 1)
    _integer(task, "questions", 1)
    _choice(task, "fit_tokenizer", FIT_TOKENIZERS)
    _choice(task, "metric", METRICS)
    for name in PARAMETERS[family]:
        if name not in task:
            raise ConfigError(f"task {task.get('name')} has no {name}: add task.{name} (RULER's value is in TASKS)")
    questions = task["questions"]
    if family in ("cwe", "fwe") and questions != 1:
        raise ConfigError(f"task.questions={questions}: {family} asks one question per context, use questions=1")
    depths = task.get("depths")
    if depths is not None:
        if family != "niah":
            raise ConfigError(f"task.depths={list(depths)}: only needle tasks place needles, use depths=null")
        if not depths or not all(_number(d) and 0 <= d <= 100 for d in depths):
            raise ConfigError(f"task.depths={depths!r}: use null or a list of depths in percent, each in [0, 100]")
    if task.get("haystack") and not (family == "niah" and task["type_haystack"] == "essay"):
        raise ConfigError("task.haystack replaces the essay haystack only: use type_haystack=essay or haystack=null")
    if task.get("text_field") is not None and not task.get("haystack"):
        raise ConfigError("task.text_field names a field of task.haystack: set task.haystack=FILE or text_field=null")
    {"niah": _check_niah, "vt": _check_vt, "cwe": _check_cwe, "fwe": _check_fwe, "qa": _check_qa}[family](task)
    paths = data_files(task, data_dir)
    if family == "qa":
        available = len(qa_data(task["dataset"], paths[0])[0])
        count = task["samples"] if documents is None else documents
        if count * questions > available:
            raise ConfigError(
                f"task {task['name']} asks {count * questions} questions ({count} documents x {questions}) of "
                f"{available} in {DATASETS[task['dataset']]}: use limit or task.samples <= {available // questions}"
            )


def _check_niah(task: Mapping[str, Any]) -> None:
    _choice(task, "type_haystack", HAYSTACKS)
    _choice(task, "type_needle_k", NEEDLE_TYPES)
    _choice(task, "type_needle_v", NEEDLE_TYPES)
    for name in ("num_needle_k", "num_needle_v", "num_needle_q"):
        _integer(task, name, 1)
    keys = max(task["num_needle_k"], task["num_needle_q"])
    needles = task["questions"] * keys * task["num_needle_v"]
    if task["type_haystack"] == "essay" and needles > len(DEPTHS):
        raise ConfigError(
            f"task {task['name']} has {needles} needles for RULER's {len(DEPTHS)} essay depths: use fewer "
            "questions, keys or values"
        )


def _check_vt(task: Mapping[str, Any]) -> None:
    _integer(task, "num_chains", 1)
    _integer(task, "num_hops", 1)


def _check_cwe(task: Mapping[str, Any]) -> None:
    for name in ("freq_cw", "freq_ucw", "num_cw"):
        _integer(task, name, 1)


def _check_fwe(task: Mapping[str, Any]) -> None:
    if not _number(task["alpha"]) or task["alpha"] <= 1:
        raise ConfigError(f"task.alpha={task['alpha']!r}: use the Zipf exponent, a number > 1 (RULER's is 2.0)")


def _check_qa(task: Mapping[str, Any]) -> None:
    _choice(task, "dataset", tuple(DATASETS))


def _integer(task: Mapping[str, Any], name: str, least: int) -> None:
    value = task.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"task.{name}={value!r}: use an integer >= {least}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _choice(task: Mapping[str, Any], name: str, valid: Sequence[str]) -> None:
    if task.get(name) not in valid:
        raise ConfigError(f"task.{name}={task.get(name)!r}: use one of {', '.join(valid)}")
