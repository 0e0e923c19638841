"""RULER's question answering tasks over SQuAD and HotpotQA (``scripts/data/synthetic/qa.py``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from h2o_eval.ruler.generator import Generator, Sample
from h2o_eval.ruler.sources import DATASETS, data_file, qa_data
from h2o_eval.ruler.tasks import DOCUMENT, STEPS


class QA(Generator):
    """RULER's qa.py: the question's gold paragraphs (SQuAD: its paragraph; HotpotQA: its ten paragraphs), then
    the other paragraphs of its SQuAD article, then random paragraphs of the whole set, as ``Document {i}:``
    blocks shuffled by a fixed permutation of their count. Document i asks question i. With ``questions: K``
    document i asks questions i*K ... i*K+K-1 (in file order): the gold and related paragraphs of all K come first,
    the rest of the assembly is RULER's."""

    step = STEPS["qa"]

    def __init__(self, task: Mapping[str, Any], count_tokens: Callable[[str], int], data_dir: Any) -> None:
        super().__init__(task, count_tokens, data_dir)
        qas, documents = qa_data(task["dataset"], data_file(data_dir, DATASETS[task["dataset"]], task))
        # RULER's qa.py shuffles its DOCS list in place when a sample takes all of them: keep a copy per run.
        self.qas, self.pool = qas, list(documents)

    def search(self) -> int:
        return self.incremental_search(cap_after=len(self.pool))

    def search_suffix(self, outputs: list[str]) -> str:
        return f" {outputs}"

    def make(self, units: int, index: int) -> Sample:
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
        return Sample(
            [self.template.format(context=context, query=qa["query"]) for qa in asked],
            [qa["outputs"] for qa in asked],
            [[] for _ in asked],
        )
