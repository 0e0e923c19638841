"""RULER's common words extraction task, cwe (``scripts/data/synthetic/common_words_extraction.py``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from h2o_eval.ruler.generator import Generator, Sample
from h2o_eval.ruler.sources import wonderwords
from h2o_eval.ruler.tasks import STEPS


class CommonWords(Generator):
    """RULER's common_words_extraction.py: a numbered list of wonderwords words (nouns, adjectives, verbs) where
    ``num_cw`` words appear ``freq_cw`` times and the others ``freq_ucw`` times (6 and 1 below 4096 tokens), after
    a solved example of 40 words (10 x 10, 30 x 3; 20 words below 4096)."""

    step = STEPS["cwe"]

    def __init__(self, task: Mapping[str, Any], count_tokens: Callable[[str], int], data_dir: Any) -> None:
        super().__init__(task, count_tokens, data_dir)
        self.words = sorted(
            set(wonderwords("nounlist.txt") + wonderwords("adjectivelist.txt") + wonderwords("verblist.txt"))
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

    def make(self, units: int, index: int) -> Sample:
        if self.length < 4096:
            example, shown = self.listing(20, 3, 1)
            listing, answer = self.listing(units, 6, 1)
        else:
            example, shown = self.listing(40, 10, 3)
            listing, answer = self.listing(units, self.task["freq_cw"], self.task["freq_ucw"])
        solved = self.template.format(context=example, query="") + _numbered(shown)
        return Sample([solved + "\n" + self.template.format(context=listing, query="")], [answer], [[]])


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))
