"""What every task's generator shares: the task's settings, its seeded stream and token counter, the cut of each
input into a document, and RULER's two loops (the search for the haystack size, then each sample at that size)."""

from __future__ import annotations

import abc
import dataclasses
import functools
import random
from collections.abc import Callable, Mapping
from typing import Any

from h2o_eval.errors import ConfigError
from h2o_eval.ruler.tasks import RETRIES, TEMPLATES, split_input


@dataclasses.dataclass
class Sample:
    """One RULER sample before it is cut: per question its full input, references and asked needles' depths."""

    inputs: list[str]
    outputs: list[list[str]]
    depths: list[list[float]]


class TooShort(Exception):
    """A draw RULER's sample loop rejects and retries (as its bare ``except`` does)."""


class Documents:
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

    def document(self, index: int, sample: Sample, fit: int, units: int) -> dict[str, Any]:
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


class Generator(Documents, abc.ABC):
    """RULER's two loops over one seeded stream: the incremental search for the haystack size whose sample fits
    the length (``search``), then each sample at that size, retried smaller while it does not fit (``sample``).
    A subclass builds a sample for a haystack size (``make``) and says how RULER measures it in the search."""

    step: int

    @abc.abstractmethod
    def make(self, units: int, index: int) -> Sample:
        """Document ``index``'s sample with a haystack of ``units`` (the search builds document 0's)."""

    @abc.abstractmethod
    def search_suffix(self, outputs: list[str]) -> str:
        """What RULER appends to an input when it measures it in the search (its answer, in its own format)."""

    def measure(self, sample: Sample) -> int:
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

    def sample(self, units: int, index: int, extra: int = 0) -> tuple[Sample, int, int]:
        """(sample, fitted tokens, haystack units) of document ``index``: RULER's retry loop, one step smaller
        after each sample that does not fit (at the smallest haystack it retries as it is; RULER forever)."""
        for _ in range(RETRIES):
            try:
                drawn = self.make(units, index)
            except TooShort:
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
