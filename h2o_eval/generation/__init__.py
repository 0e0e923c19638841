"""The one generation path every runner uses: a batch of prompts in, an :class:`~h2o_eval.cache.EvictionCache`
filled (the context compressed before the question under ``protocol=context``), ``generate()``, and per-row
outputs and record fields that read the same for every task.

A prompt is two token-id parts, ``context`` and ``question``. Under ``protocol=context`` the contexts are fed as
one chunk and compressed before any question token exists; every question of a batch has one length, so that
all contexts end in one column. Under the other protocols the prompt is whole (its question may be empty).

- :mod:`~h2o_eval.generation.batches`: a :class:`Batch` of prompts, and what is read off generated sequences;
- :mod:`~h2o_eval.generation.passes`: feeding a cache, and a policy's extra passes before its compression
  (:func:`settle`, and :func:`compress` for the Python API);
- :mod:`~h2o_eval.generation.completion`: a batch through one cache (:func:`complete`, :func:`generate`);
- :mod:`~h2o_eval.generation.answering`: documents' questions answered for several cells at once (:func:`answer`),
  each from its own copy of a compressed context or, under ``protocol=turns``, as the turns of one conversation;
- :mod:`~h2o_eval.generation.log`: what a run generated, cost and held (:class:`GenerationLog`);
- :mod:`~h2o_eval.generation.partial`: the answers so far, kept after every batch, that a stopped run resumes from.
"""

from h2o_eval.generation.answering import Answers, Cell, Document, Settings, Turns, answer
from h2o_eval.generation.batches import (
    Batch,
    available_memory,
    end_tokens,
    fitting_rows,
    greedy,
    make_batch,
    new_tokens,
    steps,
)
from h2o_eval.generation.completion import complete, generate, run_batch
from h2o_eval.generation.log import GenerationLog, Progress
from h2o_eval.generation.passes import answer_key, answers, compress, decode, feed, settle

__all__ = [
    "Answers",
    "Batch",
    "Cell",
    "Document",
    "GenerationLog",
    "Progress",
    "Settings",
    "Turns",
    "answer",
    "answer_key",
    "answers",
    "available_memory",
    "complete",
    "compress",
    "decode",
    "end_tokens",
    "feed",
    "fitting_rows",
    "generate",
    "greedy",
    "make_batch",
    "new_tokens",
    "run_batch",
    "settle",
    "steps",
]
