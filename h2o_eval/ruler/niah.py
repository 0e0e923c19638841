"""RULER's needle-in-a-haystack tasks (``scripts/data/synthetic/niah.py``): needles in an essay, among noise
lines or among distractor needles, with the needle insertion RULER does."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from h2o_eval.errors import ConfigError
from h2o_eval.ruler.generator import Generator, Sample
from h2o_eval.ruler.sources import adjective_nouns, essay_words, punkt_tokenizer
from h2o_eval.ruler.tasks import DEPTHS, NEEDLE, NOISE, STEPS


class Niah(Generator):
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
        self.words = adjective_nouns() if "words" in (self.type_k, self.type_v) else None
        self.sentences: dict[int, list[str]] = {}
        if self.haystack == "essay":
            self.essay = essay_words(task, self.data_dir)
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

    def make(self, units: int, index: int) -> Sample:
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
        sample = Sample([], [], [])
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
            self.sentences[words] = punkt_tokenizer().tokenize(" ".join(self.essay[:words]).strip())
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
