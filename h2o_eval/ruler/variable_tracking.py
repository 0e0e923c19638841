"""RULER's variable tracking task (``scripts/data/synthetic/variable_tracking.py``)."""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from h2o_eval.ruler.generator import Generator, Sample, TooShort
from h2o_eval.ruler.tasks import NOISE, STEPS, TEMPLATES


class VariableTracking(Generator):
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
        solver = VariableTracking({**self.task, "length": 500, "questions": 1}, self.count, self.data_dir, True)
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
                raise TooShort
            statements[-1] += [f"VAR {chain[j + 1]} = VAR {chain[j]} " for j in range(hops)]
        return variables, statements

    def make(self, units: int, index: int) -> Sample:
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
        sample = Sample([], [], [])
        for c in range(self.questions):
            value = chains[c][0].split("=")[-1].strip()
            sample.inputs.append(self.template.format(context=context, query=value, num_v=self.hops + 1))
            sample.outputs.append(variables[c])
            sample.depths.append([round(100 * line_of[c, j] / len(lines), 2) for j in range(len(chains[c]))])
        return sample
