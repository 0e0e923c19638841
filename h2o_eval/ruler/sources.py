"""What RULER's tasks read: the data files under ``data_dir`` (the essays, SQuAD and HotpotQA), wonderwords 2.2.0's
word lists, RULER's sorted adjective-noun keys and nltk's Punkt splitter with its English parameters."""

from __future__ import annotations

import collections
import functools
import importlib.metadata
import re
import warnings
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from h2o_eval.data import read_jsonl
from h2o_eval.errors import ConfigError

DATASETS = {"squad": "squad_v2/validation.jsonl", "hotpotqa": "hotpotqa/validation.jsonl"}
ESSAYS = "paul_graham_essays/essays.jsonl"
WONDERWORDS = "2.2.0"  # the lists RULER read in 2024; 3.0 dropped four nouns, which reshuffles every key


def data_files(task: Mapping[str, Any], data_dir: str | Path | None) -> list[Path]:
    """The files the task reads (for the record's identity): the essay haystack (or ``task.haystack``) of the
    essay needle tasks, the question set of qa; none for noise and needle haystacks, vt, cwe and fwe."""
    if task["family"] == "qa":
        return [data_file(data_dir, DATASETS[task["dataset"]], task)]
    if task["family"] == "niah" and task["type_haystack"] == "essay":
        if task.get("haystack"):
            path = Path(task["haystack"])
            if not path.is_file():
                raise ConfigError(f"task.haystack={path} does not exist: give a JSONL file of texts, or null")
            return [path]
        return [data_file(data_dir, ESSAYS, task)]
    return []


def data_file(data_dir: str | Path | None, name: str, task: Mapping[str, Any]) -> Path:
    """The file ``name`` under ``data_dir`` that ``task`` reads; refused in one line when it is not there."""
    if data_dir is None:
        raise ConfigError(f"task {task['name']} reads {name}: set data_dir=PATH (the folder holding it)")
    path = Path(data_dir) / name
    if not path.is_file():
        raise ConfigError(f"task {task['name']} reads {path}, which does not exist: put it there or fix data_dir")
    return path


@functools.lru_cache(maxsize=4)
def qa_data(dataset: str, path: Path) -> tuple[list[dict[str, Any]], list[str]]:
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


def wonderwords(name: str) -> list[str]:
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


class SortedPairs(Sequence[str]):
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
def adjective_nouns() -> SortedPairs:
    """RULER's niah word keys: every adjective-noun pair of wonderwords' lists, sorted (read once a process)."""
    return SortedPairs(wonderwords("adjectivelist.txt"), wonderwords("nounlist.txt"))


@functools.lru_cache(maxsize=1)
def punkt_tokenizer() -> Any:
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


def essay_words(task: Mapping[str, Any], data_dir: Any) -> list[str]:
    """RULER's essay haystack as words: the texts concatenated with nothing between them (as RULER's download
    script joins the essays), whitespace runs made single spaces, split at spaces."""
    path = data_files(task, data_dir)[0]
    field = task.get("text_field") or "text"
    return words_of(path, field)


@functools.lru_cache(maxsize=4)
def words_of(path: Path, field: str) -> list[str]:
    """The words of :func:`essay_words` from the ``field`` of each row of ``path`` (read once a process)."""
    texts = [row[field] for row in read_jsonl(path, (field,))]
    return re.sub(r"\s+", " ", "".join(texts)).split(" ")
