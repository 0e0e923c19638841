"""RULER's frequent words extraction task, fwe (``scripts/data/synthetic/freq_words_extraction.py``)."""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from h2o_eval.ruler.generator import Documents, Sample


class FrequentWords(Documents):
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
            documents.append(self.document(index, Sample([text], [answer], [[]]), self.count(text), used))
        return documents
