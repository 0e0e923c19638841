"""RULER's thirteen tasks as data: their parameters under RULER's names (``TASKS``), the templates of RULER's
``constants.py``, the needle, noise and document texts, the 40 needle depths and the search's steps, and where
kvpress cuts an input into context, question and answer prefix (:func:`split_input`)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

FAMILIES = ("niah", "vt", "cwe", "fwe", "qa")
FIT_TOKENIZERS = ("model", "llama3")
METRICS = ("string_match_all", "string_match_part")
HAYSTACKS = ("repeat", "essay", "needle")
NEEDLE_TYPES = ("numbers", "words", "uuids")


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


def split_input(family: str, text: str) -> tuple[str, str, str]:
    """A RULER input cut into (context, question, answer prefix) where kvpress cuts it (see
    :mod:`h2o_eval.ruler`)."""
    at = list(QUESTION_PATTERNS[family].finditer(text))[-1].start()
    context, rest = text[:at], text[at:]
    answer = ANSWER_PATTERNS[family].search(rest).start()
    return context, rest[:answer], rest[answer:]
