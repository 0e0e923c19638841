"""Answering documents' questions for several cells at once: a context fed once for every cell's cache, each cache
compressed by its own policy, a copy of it per question, and the decoding, alone or stacked.

A :class:`Document` is a context and its questions as token ids. :func:`answer` answers every question of every
document for every :class:`Cell` (a policy under a protocol) and returns, per cell, the generated fields of each
question and the cell's :class:`~h2o_eval.generation.log.GenerationLog`:

- under ``protocol=context`` the contexts of a batch are fed once (through a
  :class:`~h2o_eval.groups.SharedPrompt` of every cell's cache when there are several) and compressed before any
  question exists; a policy that scores by extra passes runs them first, once for the cells that differ only in
  budget; each question is then answered from its own copy of each cell's compressed cache
  (:meth:`~h2o_eval.cache.EvictionCache.fork`), so that no question sees another's tokens or answer, or, with
  ``stack``, from the copies of every cell stacked into one batch (:meth:`~h2o_eval.cache.EvictionCache.stack`);
- under ``prefill`` and ``simulate`` each question is a prompt of its own (context + question); under ``prefill``
  with several cells the prompt pass, and the first new token, which depends on it alone, are shared;
- under ``turns`` one document at a time: its context is fed once for every cell and compressed as under
  ``context``, then its questions are the turns of one conversation in each cell's cache (:class:`Turns`: what a turn
  leaves, and when the cache is compressed again), stacked across cells under the gold history with ``stack``.

A cell's time (wall and CPU, the latter by part) counts its share of a shared pass (and of a stacked decode).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from h2o_eval.cache import EvictionCache
from h2o_eval.generation.batches import Batch, end_tokens, greedy, make_batch, new_tokens, steps
from h2o_eval.generation.completion import complete
from h2o_eval.generation.log import GenerationLog, Progress, cpu_into, cpu_parts, shared
from h2o_eval.generation.partial import Partial
from h2o_eval.generation.passes import answer_key, decode, decode_leaving, feed, settle
from h2o_eval.groups import SharedPrompt
from h2o_eval.policies import Interval, Policy


@dataclass(frozen=True)
class Cell:
    """One evaluation among those answered together: a policy under a protocol."""

    policy: Policy
    protocol: str


@dataclass(frozen=True)
class Document:
    """A context and its questions, as token ids; question ``k`` follows the context as its prompt's end. Under
    ``protocol=turns`` the questions are a conversation's turns: question ``k`` > 0 follows turn ``k - 1``'s
    history (opening a user turn), ``answers[k]`` is turn ``k``'s gold answer with the end of its assistant turn,
    and ``end`` what ends an assistant turn (:class:`Turns`)."""

    context: list[int]
    questions: list[list[int]]
    answers: list[list[int]] = field(default_factory=list)
    end: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Turns:
    """``protocol=turns``: the history a turn leaves in the cache (``gold``: the question and the gold answer, the
    model's own answer dropped, SCBench's default; ``own``: the question and the model's answer, closed by the end of
    its turn, SCBench's ``--disable_golden_context``) and when the cache is compressed (``once``: the context only;
    ``nested``: then everything held after each turn; ``new_turn``: then each turn's own tokens, FlowKV's
    schedules)."""

    history: str = "gold"
    schedule: str = "once"


@dataclass
class Answers:
    """One cell's answers: ``rows``, per question (document index, question index, the generated fields of
    :meth:`~h2o_eval.generation.log.GenerationLog.add`, its ``tokens`` among them), and the cell's ``log``."""

    log: GenerationLog
    rows: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        """Its rows and log as JSON's types, kept after every batch (:mod:`~h2o_eval.generation.partial`)."""
        return {"log": self.log.state(), "rows": [list(row) for row in self.rows]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Answers:
        return cls(GenerationLog.from_state(state["log"]), [(d, k, fields) for d, k, fields in state["rows"]])


@dataclass(frozen=True)
class Settings:
    """How the cells answer: greedy tokens up to ``max_new_tokens``, ``batch_size`` documents (or prompts) at a time,
    the caches' ``kernels``, ``decoding`` rule (and ``decoding=interval``'s settings) and ``graphs``, and whether
    copies are decoded stacked."""

    max_new_tokens: int
    batch_size: int
    kernels: str = "auto"
    decoding: str = "evict"
    graphs: bool | str = True
    stack: bool = False
    interval: Interval | None = None
    turns: Turns = Turns()


def answer(
    model: Any,
    tokenizer: Any,
    cells: Sequence[Cell],
    documents: Sequence[Document],
    settings: Settings,
    label: str = "answering",
    partial: Partial | None = None,
) -> list[Answers]:
    """Every question of every document, answered greedily by every cell (see the module); returns each cell's
    :class:`Answers`, questions in document order. ``partial``: where the answers so far are kept after every
    batch, and what a stopped run of the same cells and settings left is taken up from, in the batches it answered
    (:mod:`~h2o_eval.generation.partial`); then each cell's log says what the runs before answered and spent
    (``resumed``). The caller removes its file once the records are written."""
    partial = partial or Partial(None)
    earlier = partial.load(settings.batch_size)
    if earlier is not None:  # its batches, which fit (as the answers kept were made)
        settings = dataclasses.replace(settings, batch_size=earlier.size)
    run = _Answering(model, tokenizer, cells, documents, settings, partial)
    kept = [0] * len(cells)
    if earlier is not None:
        run.answers, run.done = [Answers.from_state(state) for state in earlier.answers], set(earlier.batches)
        kept = [len(answers.rows) for answers in run.answers]
    protocols = sorted({cell.protocol for cell in cells})
    questions = sum(len(document.questions) for document in documents)
    with Progress(questions * len(cells), label, "answer") as run.progress:
        if earlier is not None:
            run.progress.resume(
                sum(kept), f"{label}: resumed from {partial.path}, {sum(kept)} of {questions * len(cells)} answers kept"
            )
        for protocol in protocols:
            members = [i for i, cell in enumerate(cells) if cell.protocol == protocol]
            if protocol == "context":
                run.contexts(members)
            elif protocol == "turns":
                run.conversations(members)
            else:
                run.prompts(members, protocol)
    for answers, count in zip(run.answers, kept, strict=True):
        answers.rows.sort(key=lambda row: row[:2])
        if earlier is not None:
            answers.log.resumed = {
                "answers": count,
                "cpu_seconds": round(earlier.cpu_seconds / len(cells), 3),
                "wall_seconds": round(earlier.wall_seconds / len(cells), 3),
                "git": earlier.git,
            }
    return run.answers


class _Answering:
    """The state of one :func:`answer`: each cell's answers so far, and how batches are answered."""

    def __init__(
        self,
        model,
        tokenizer,
        cells: Sequence[Cell],
        documents: Sequence[Document],
        settings: Settings,
        partial: Partial,
    ):
        self.model, self.tokenizer, self.cells, self.documents = model, tokenizer, cells, documents
        self.settings = settings
        self.greedy = greedy(settings.max_new_tokens, tokenizer.pad_token_id)
        self.ends = end_tokens(tokenizer)
        self.answers = [Answers(GenerationLog(max_new_tokens=settings.max_new_tokens)) for _ in cells]
        self.device = next(model.parameters()).device
        self.progress: Any = None
        self.partial = partial
        self.done: set[tuple[str, int]] = set()  # the batches answered, as (protocol, first unit)
        # The full cache's answers the oracle's passes need, per prompt of the current batch: its cells at several
        # budgets generate each once.
        self.answered: dict[Any, list[list[int]]] = {}

    def _caches(self, members: list[int], protocol: str) -> dict[int, EvictionCache]:
        settings = self.settings
        return {
            i: EvictionCache(
                self.model,
                self.cells[i].policy,
                protocol=protocol,
                kernels=settings.kernels,
                decoding=settings.decoding,
                graphs=settings.graphs,
                interval=settings.interval,
            )  # fmt: skip
            for i in members
        }

    def _answer(
        self, i: int, cache: EvictionCache, batch: Batch, seconds: float, units: list, cpu=None, asked=None
    ) -> None:
        """Decode one batch of questions through cell ``i``'s ``cache`` and keep its outputs (logged as ``asked``'s,
        the batch before a shared pass extended it, where given); ``seconds`` already spent on it (a share of a
        shared pass; ``cpu``, its CPU seconds by part) count in its time."""
        began, cpu = time.perf_counter(), cpu or cpu_parts()
        sequences = complete(self.model, cache, batch, self.tokenizer, self.answered, cpu=cpu, **self.greedy)
        self._keep(i, asked or batch, sequences, cache, seconds + time.perf_counter() - began, units, cpu)

    def _keep(self, i: int, batch: Batch, sequences, cache, seconds: float, units: list, cpu: dict) -> None:
        """Log cell ``i``'s finished batch (its ``cache``, the ``seconds`` and the CPU seconds by part it cost) and
        keep a row per question."""
        answers = self.answers[i]
        generated = answers.log.add(batch, sequences, cache, seconds, self.ends, cpu)
        answers.rows += [(d, k, g) for (d, k), g in zip(units, generated, strict=True)]
        self.progress.update(len(units), ends_batch=False)

    def _settle(self, caches: dict[int, EvictionCache], ids, mask, cpu: dict[int, dict]) -> dict[int, float]:
        """Compress the cells' deferred contexts after their policies' extra passes (not the oracle's, whose passes
        differ per question): one run of the passes for the cells whose policies differ only in budget
        (:meth:`~h2o_eval.policies.Policy.rehearsal_identity`), the others taking its scores. Returns each cell's
        share of the time (and its CPU seconds in ``cpu``'s ``scoring``)."""
        spent = dict.fromkeys(caches, 0.0)
        together: dict[str, list[int]] = {}
        for i, cache in caches.items():
            if cache.deferred and not cache.policy.needs_answer:
                together.setdefault(cache.policy.rehearsal_identity(), []).append(i)
        for first, *rest in together.values():
            began, scoring = time.perf_counter(), cpu_parts()
            with cpu_into(scoring, "scoring"):
                settle(
                    self.model, caches[first], self.tokenizer, ids, mask, [[]] * ids.shape[0],
                    siblings=[caches[j] for j in rest], **self.greedy,
                )  # fmt: skip
            share = (time.perf_counter() - began) / (1 + len(rest))
            for j in (first, *rest):
                spent[j] = share
                cpu[j]["scoring"] += scoring["scoring"] / (1 + len(rest))
        return spent

    def _starts(self, protocol: str, count: int, size: int) -> Iterator[int]:
        """The first unit of each batch of ``count`` units (documents, or prompts) under ``protocol`` not answered
        yet; once the caller has answered one, the answers so far are kept (:attr:`partial`)."""
        for start in range(0, count, size):
            if (protocol, start) in self.done:
                continue
            yield start
            self.progress.batch_ended()
            self.done.add((protocol, start))
            self.partial.save(size, self.done, [answers.state() for answers in self.answers])

    def contexts(self, members: list[int]) -> None:
        """``protocol=context``: per batch of documents, the contexts are fed (once for every cell) and
        compressed; then each question, a group of rows whose questions have one length at a time, is answered
        from a copy of each cell's compressed cache (the cache itself for the last group when it takes every
        row; with ``stack``, the copies of every cell stacked: :meth:`_answer_together`). A policy that scores by
        extra passes runs them before its compression (:func:`~h2o_eval.generation.passes.settle`), once for the
        cells that differ only in budget; one whose passes need the question and answer (the oracle) compresses
        each question's copy for that question."""
        size = self.settings.batch_size
        for start in self._starts("context", len(self.documents), size):
            indices = list(range(start, min(start + size, len(self.documents))))
            items = [self.documents[d] for d in indices]
            self.progress.phase(f"documents {indices[0] + 1}-{indices[-1] + 1}: contexts")
            self.answered = {}
            contexts = make_batch(
                [item.context for item in items], [[] for _ in items], self.tokenizer.pad_token_id, self.device,
                split=False,
            )  # fmt: skip
            caches = self._caches(members, "context")
            began, prompt = time.perf_counter(), cpu_parts()
            feeder = caches[members[0]] if len(members) == 1 else SharedPrompt(list(caches.values()))
            with cpu_into(prompt, "prompt"):
                feed(self.model, feeder, contexts.input_ids, contexts.attention_mask)
            del feeder  # a SharedPrompt holds every cache's layers: each is freed once its cell has answered
            share = (time.perf_counter() - began) / len(members)
            cpu = {i: shared(prompt, len(members)) for i in members}
            groups = [
                (k, [r for r, item in enumerate(items) if len(item.questions) > k and len(item.questions[k]) == n])
                for k in range(max(len(item.questions) for item in items))
                for n in sorted({len(item.questions[k]) for item in items if len(item.questions) > k})
            ]
            ids, mask = contexts.input_ids, contexts.attention_mask
            self.progress.phase(f"documents {indices[0] + 1}-{indices[-1] + 1}: answering")
            settled = self._settle(caches, ids, mask, cpu)
            batches = []
            for k, rows in groups:
                questions = torch.tensor([items[r].questions[k] for r in rows], device=self.device)
                kept = mask[rows]
                batch = Batch(
                    torch.cat([ids[rows], questions], dim=1),
                    torch.cat([kept, kept.new_ones(questions.shape)], dim=1),
                    contexts.input_ids.shape[1],
                )
                batches.append((rows, batch, [(indices[r], k) for r in rows]))
            if self.settings.stack and len(members) > 1:
                self._answer_together({i: caches.pop(i) for i in members}, batches, share, settled, cpu, len(items))
            for i in [i for i in members if i in caches]:
                cache, seconds, spent = caches.pop(i), share + settled[i], cpu[i]
                for position, (rows, batch, units) in enumerate(batches):
                    last = position == len(batches) - 1 and len(rows) == len(items)
                    self._answer(i, cache if last else cache.fork(rows), batch, seconds, units, spent)
                    seconds, spent = 0.0, None

    def _answer_together(
        self,
        caches: dict[int, EvictionCache],
        batches: list,
        share: float,
        settled: dict,
        cpu: dict[int, dict],
        documents: int,
    ) -> None:
        """``stack``: each group of questions is answered by every cell in ``caches`` (compressed, under
        ``decoding=grow``) in one batch, their copies stacked (:meth:`~h2o_eval.cache.EvictionCache.stack`); each
        cell then keeps its rows, as long as its own generation would have run, and the peak its cache would
        have reached. The oracle's cells, whose copies are compressed for the question and the full cache's
        answer, answer in a second batch: that answer comes from a full copy of their context
        (:meth:`~h2o_eval.cache.EvictionCache.full_copy`) stacked in the first. A batch's decoding time is
        shared equally among its cells (the full copy's share among the oracle's). The last group, where it takes
        all ``documents`` rows, stacks the caches themselves (a stack leaves them as they were), not copies."""
        plain = [i for i in caches if not caches[i].policy.needs_answer]
        asking = [i for i in caches if caches[i].policy.needs_answer]
        seconds = {i: share + settled[i] for i in caches}
        for position, (rows, batch, units) in enumerate(batches):
            last = position == len(batches) - 1 and len(rows) == documents
            forks = [caches.pop(i) if last else caches[i].fork(rows) for i in plain]
            if asking:
                forks.append(caches[asking[0]].fork(rows).full_copy())
            sequences, spent, full_cpu = self._decode_stacked(forks, plain, batch, units, seconds, cpu)
            if not asking:
                continue
            width = batch.context_width
            key = answer_key(batch.input_ids, batch.attention_mask, **self.greedy)
            self.answered[key] = new_tokens(sequences[-1], batch.input_ids.shape[1], self.ends)
            questions = batch.input_ids[:, width:].tolist()
            compressed = []
            for i in asking:  # one uncompressed copy of the context at a time
                began = time.perf_counter()
                compressed.append(caches[i].fork(rows))
                with cpu_into(cpu[i], "scoring"):
                    settle(
                        self.model, compressed[-1], self.tokenizer, batch.input_ids[:, :width],
                        batch.attention_mask[:, :width], questions, answered=self.answered, **self.greedy,
                    )  # fmt: skip
                seconds[i] += spent / len(asking) + time.perf_counter() - began
                for part, value in full_cpu.items():
                    cpu[i][part] += value / len(asking)
            self._decode_stacked(compressed, asking, batch, units, seconds, cpu)

    def _decode_stacked(
        self, forks: list, cells: list[int], batch: Batch, units: list, seconds: dict, cpu: dict[int, dict]
    ) -> tuple:
        """Decode ``batch`` through ``forks`` stacked, the first of which are ``cells``' copies, a row leaving the
        batch when its answer ends (:func:`~h2o_eval.generation.passes.decode_leaving`): each of those keeps its
        rows, cut to the steps its own generation would have run, and the peak its cache would have reached.
        ``forks`` is emptied: the stack holds them alone, so what a view outgrows is freed (their statistics are
        taken first). Returns every fork's sequences, and the decoding time and CPU seconds by part per fork."""
        began, decoded, count = time.perf_counter(), cpu_parts(), len(forks)
        kept = [fork.statistics() for fork in forks[: len(cells)]]
        ids, mask = batch.input_ids.repeat(count, 1), batch.attention_mask.repeat(count, 1)
        sequences = decode_leaving(
            self.model, stack_taking(forks), ids, mask, cpu=decoded, tokenizer=self.tokenizer, **self.greedy
        )  # nothing but decode_leaving holds the stack, so each stack it leaves behind is freed
        spent, each = (time.perf_counter() - began) / count, shared(decoded, count)
        width, question, rows = ids.shape[1], ids.shape[1] - batch.context_width, batch.input_ids.shape[0]
        own = [sequences[c * rows : (c + 1) * rows] for c in range(count)]
        for i, statistics, sequence in zip(cells, kept, own, strict=False):
            cut = sequence[:, : width + steps(self.model, sequence, width)]
            grown = statistics.grown(question + cut.shape[1] - width - 1)
            self._keep(i, batch, cut, grown, seconds[i] + spent, units, {k: v + each[k] for k, v in cpu[i].items()})
            seconds[i], cpu[i] = 0.0, cpu_parts()
        return own, spent, each

    def conversations(self, members: list[int]) -> None:
        """``protocol=turns``: one document at a time, its context is fed (once for every cell) and compressed as
        under ``context``; then each cell holds one conversation in its cache, turn after turn (:meth:`_converse`),
        or, with ``stack`` under ``gold``, the cells' turns are answered together (:meth:`_converse_together`). The
        model's own answers make each cell's conversation its own, so under ``own`` each cell answers alone."""
        for start in self._starts("turns", len(self.documents), 1):
            document = self.documents[start]
            self.progress.phase(f"document {start + 1}: context")
            self.answered = {}
            ids = torch.tensor([document.context], device=self.device)
            mask = torch.ones_like(ids)
            caches = self._caches(members, "context")
            began, prompt = time.perf_counter(), cpu_parts()
            feeder = caches[members[0]] if len(members) == 1 else SharedPrompt(list(caches.values()))
            with cpu_into(prompt, "prompt"):
                feed(self.model, feeder, ids, mask)
            del feeder
            share = (time.perf_counter() - began) / len(members)
            cpu = {i: shared(prompt, len(members)) for i in members}
            settled = self._settle(caches, ids, mask, cpu)
            self.progress.phase(f"document {start + 1}: {len(document.questions)} turns")
            spent = {}
            for i in members:
                began = time.perf_counter()
                if caches[i].deferred:  # the oracle: its context compressed for the first question
                    with cpu_into(cpu[i], "scoring"):
                        settle(
                            self.model, caches[i], self.tokenizer, ids, mask, [document.questions[0]],
                            answered=self.answered, **self.greedy,
                        )  # fmt: skip
                spent[i] = share + settled[i] + time.perf_counter() - began
            if self.settings.stack and len(members) > 1 and self.settings.turns.history == "gold":
                self._converse_together(caches, start, spent, cpu)
            for i in members:
                if i in caches:
                    self._converse(i, caches.pop(i), start, spent[i], cpu[i])

    def _converse(self, i: int, cache: EvictionCache, d: int, seconds: float, cpu: dict) -> None:
        """Cell ``i``'s conversation over document ``d`` in ``cache`` (its context compressed), one row per turn.
        Turn ``k`` > 0 first feeds the history turn ``k - 1`` left (:class:`Turns`) as one chunk and, under
        ``nested`` or ``new_turn``, compresses the cache by the attention inputs fed since the last compression; its
        question then follows and is answered greedily, from a copy of the cache under ``gold`` (its answer is
        dropped with the copy), in the cache itself under ``own`` (the last generated token, never fed, opens the
        history)."""
        document, turns = self.documents[d], self.settings.turns
        fed, history = list(document.context), []
        for k, question in enumerate(document.questions):
            began = time.perf_counter()
            self._open_turn(cache, fed, history, k < len(document.questions) - 1, cpu)
            fed += history
            ids = torch.tensor([fed + question], device=self.device)
            batch = Batch(ids, torch.ones_like(ids), len(fed))
            answering = cache.fork([0]) if turns.history == "gold" else cache
            sequences = decode(
                self.model, answering, ids, batch.attention_mask, cpu=cpu, tokenizer=self.tokenizer, **self.greedy
            )
            self._keep(i, batch, sequences, answering, seconds + time.perf_counter() - began, [(d, k)], cpu)
            seconds, cpu = 0.0, cpu_parts()
            if turns.history == "gold":
                history = question + document.answers[k]
            else:
                generated = sequences[0].tolist()
                last, fed = generated[-1], generated[:-1]
                history = [last] + (document.end[1:] if document.end[:1] == [last] else document.end)

    def _open_turn(self, cache: EvictionCache, fed: list[int], history: list[int], more: bool, cpu: dict) -> None:
        """A turn's start in ``cache``, which has seen ``fed``: the ``history`` the turn before left (none before the
        first) fed as one chunk and, under ``nested`` or ``new_turn``, the cache compressed; then, where ``more``
        turns follow, the attention inputs kept for the next compression."""
        schedule = self.settings.turns.schedule
        if history:
            with cpu_into(cpu, "prompt"):
                extend(self.model, cache, fed, history)
            if schedule != "once":
                with cpu_into(cpu, "scoring"):
                    cache.compress_turn(schedule)
        if schedule != "once" and more:
            cache.begin_turn()

    def _converse_together(self, caches: dict[int, EvictionCache], d: int, seconds: dict, cpu: dict) -> None:
        """``stack`` under ``gold``: the cells' conversations over document ``d`` turn by turn together. Their
        histories are the same tokens, so at each turn every cell's cache takes the history (and its compression)
        on its own, and a copy of each answers the question in one batch, the copies stacked
        (:meth:`_decode_stacked`, under ``decoding=grow``). ``caches`` is emptied."""
        document = self.documents[d]
        fed, history = list(document.context), []
        for k, question in enumerate(document.questions):
            for i, cache in caches.items():
                began = time.perf_counter()
                self._open_turn(cache, fed, history, k < len(document.questions) - 1, cpu[i])
                seconds[i] += time.perf_counter() - began
            fed += history
            ids = torch.tensor([fed + question], device=self.device)
            batch = Batch(ids, torch.ones_like(ids), len(fed))
            self._decode_stacked(
                [cache.fork([0]) for cache in caches.values()], list(caches), batch, [(d, k)], seconds, cpu
            )
            history = question + document.answers[k]
        caches.clear()

    def prompts(self, members: list[int], protocol: str) -> None:
        """``prefill`` and ``simulate``: every (document, question) is a prompt of its own, compressed alone; under
        ``prefill`` with several cells the prompt pass (and the first new token, which depends on it alone) is
        shared."""
        units = [(d, k) for d, document in enumerate(self.documents) for k in range(len(document.questions))]
        size = self.settings.batch_size
        for start in self._starts(protocol, len(units), size):
            chunk = units[start : start + size]
            self.progress.phase(f"prompts {start + 1}-{start + len(chunk)} of {len(units)}")
            self.answered = {}
            batch = make_batch(
                [self.documents[d].context for d, _ in chunk], [self.documents[d].questions[k] for d, k in chunk],
                self.tokenizer.pad_token_id, self.device, split=False,
            )  # fmt: skip
            if len(members) == 1 or protocol == "simulate":
                for i in members:
                    cache = self._caches([i], protocol)[i]
                    self._answer(i, cache, batch, 0.0, chunk)
                continue
            caches = self._caches(members, protocol)
            began, prompt = time.perf_counter(), cpu_parts()
            together = SharedPrompt(list(caches.values()))
            first = decode(
                self.model, together, batch.input_ids, batch.attention_mask, cpu=prompt, first="prompt",
                **self.greedy | {"max_new_tokens": 1},
            )  # fmt: skip
            del together
            share, each = (time.perf_counter() - began) / len(members), shared(prompt, len(members))
            extended = Batch(
                first,
                torch.cat([batch.attention_mask, batch.attention_mask.new_ones(len(chunk), 1)], dim=-1),
                generated=1,
            )
            for i in members:
                cache = caches.pop(i)
                self._answer(i, cache, extended, share, chunk, dict(each), batch)


def extend(model: Any, cache: EvictionCache, fed: list[int], chunk: list[int]) -> None:
    """Feed ``chunk`` (token ids of one sequence) through ``cache``, which has seen ``fed``, as one chunk at the
    positions after it; its logits are never read."""
    ids = torch.tensor([chunk], device=next(model.parameters()).device)
    mask = torch.ones(1, len(fed) + len(chunk), dtype=torch.int64, device=ids.device)
    with torch.no_grad():
        model(
            ids,
            attention_mask=mask,
            position_ids=torch.arange(len(fed), len(fed) + len(chunk), device=ids.device).view(1, -1),
            use_cache=True,
            logits_to_keep=1,
            cache=cache,
        )


def stack_taking(forks: list[EvictionCache]) -> Any:
    """``forks`` stacked (:meth:`~h2o_eval.cache.EvictionCache.stack`), the list emptied: the stack's views then
    hold what they held alone."""
    stack = EvictionCache.stack(forks)
    forks.clear()
    return stack
