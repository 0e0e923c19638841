"""What a run's generation cost and held, and its progress on the terminal."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from h2o_eval.cache import EvictionCache, Statistics
from h2o_eval.capacity import CapacityLog
from h2o_eval.generation.batches import Batch, new_tokens

# The parts of a generation's CPU time in a record (``generation.cpu_seconds``): the prompt's pass (the context's under
# protocol=context; a cell's share where cells share it), with the compression a policy makes as its prompt comes;
# scoring (a policy's extra passes, KVzip's repeat or the oracle's answer, and the compression they decide); the
# question's pass (its columns after a compressed context); decoding (a token a forward).
PARTS = ("prompt", "scoring", "question", "decoding")


def cpu_parts() -> dict[str, float]:
    return dict.fromkeys(PARTS, 0.0)


@contextmanager
def cpu_into(parts: dict[str, float] | None, part: str) -> Iterator[None]:
    """Add the block's CPU seconds (the process's, every thread's) to ``parts[part]`` (nothing where ``parts`` is
    None)."""
    began = time.process_time()
    try:
        yield
    finally:
        if parts is not None:
            parts[part] += time.process_time() - began


@contextmanager
def forwards_into(model: Any, parts: dict[str, float] | None, first: str) -> Iterator[None]:
    """Add the CPU seconds of each forward of ``model`` in the block to ``parts``: the first forward's to ``first``
    (the question's columns, or the prompt's), every later one's (a token each) to ``decoding``."""
    if parts is None:
        yield
        return
    began: list[float] = []

    def before(module: Any, args: Any) -> None:
        began.append(time.process_time())

    def after(module: Any, args: Any, output: Any) -> None:
        parts[first if len(began) == 1 else "decoding"] += time.process_time() - began[-1]

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def shared(parts: Mapping[str, float], count: int) -> dict[str, float]:
    """Each of ``count`` cells' share of ``parts`` spent on them together."""
    return {part: seconds / count for part, seconds in parts.items()}


class Progress:
    """A progress bar over a run's units (documents; a cell's answer to a question), with the time left by the run's
    mean rate (units come in bursts; a moving average of the last few would swing with each). It also says once,
    after the first batch, about how long the rest will take (a line in a log, where the bar's own estimate is
    overwritten), and redraws itself every ``every`` seconds between units, with what is being done now
    (:meth:`phase`), so that a long prompt pass still shows the run alive. Used as a context
    manager, it is closed however the run ends."""

    def __init__(self, total: int, description: str, unit: str, every: float = 30.0) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=description, unit=unit, smoothing=0)
        self.total, self.description, self.unit = total, description, unit
        self.began = time.perf_counter()
        self.told = False
        self.kept = 0  # units a stopped run had done (resume)
        self.stopped = threading.Event()
        self.redraws = threading.Thread(target=self._redraw, args=(every,), daemon=True)
        self.redraws.start()

    def _redraw(self, every: float) -> None:
        while not self.stopped.wait(every):
            self.bar.refresh()

    def phase(self, text: str) -> None:
        """Show what the run does now (``documents 1-8: contexts``) beside the bar, at once."""
        self.bar.set_postfix_str(text, refresh=True)

    def resume(self, count: int, text: str) -> None:
        """Start from ``count`` units a stopped run had done, saying ``text``; rates and the time left are this
        run's."""
        self.bar.write(text, file=sys.stderr)
        self.bar.n = self.bar.last_print_n = self.bar.initial = self.kept = count
        self.bar.refresh()

    def update(self, count: int, ends_batch: bool = True) -> None:
        """Count ``count`` more units done. Once the first batch has ended (``ends_batch``), say how long the rest
        will take by its rate; units that do not end one (a grid's cells answering a batch one after another, after
        its shared passes) would charge those passes to the first units alone."""
        self.bar.update(count)
        if ends_batch:
            self.batch_ended()

    def batch_ended(self) -> None:
        """A batch of units has ended: after the first, say once how long the rest will take."""
        done = self.bar.n
        if not self.told and self.kept < done < self.total:
            elapsed = time.perf_counter() - self.began
            left = elapsed / (done - self.kept) * (self.total - done)
            self.bar.write(
                f"{self.description}: ~{max(left / 60, 1):.0f} min left ({done - self.kept} of "
                f"{self.total - self.kept} {self.unit}s in {elapsed:.0f} s)",
                file=sys.stderr,
            )
            self.told = True

    def close(self) -> None:
        self.stopped.set()
        self.redraws.join()
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exception) -> None:
        self.close()  # the redraws stop however the run ends


@dataclass
class GenerationLog:
    """What a run's generation cost and held, batch by batch; ``fields()`` is the record's ``generation`` and
    ``capacity`` (:class:`~h2o_eval.capacity.CapacityLog`), the same keys for every runner."""

    max_new_tokens: int
    capacity: CapacityLog = field(default_factory=CapacityLog)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rows: int = 0
    seconds: float = 0.0
    peak_entries: int = 0
    allocated_bytes: float = 0.0  # the bytes of keys and values the batches' caches had allocated, summed over rows
    full_entries: int = 0
    entry_bytes: int = 0
    graphs_failed: str | None = None  # why a cache's decode steps could not be captured as CUDA graphs (then eager)
    cpu: dict[str, float] = field(default_factory=cpu_parts)  # CPU seconds by part (PARTS)
    resumed: dict[str, Any] | None = None  # what the runs this one resumed had answered and spent (partial.py)

    def add(
        self,
        batch: Batch,
        sequences: torch.Tensor,
        cache: EvictionCache | Statistics,
        seconds: float,
        ends: set[int],
        cpu: Mapping[str, float] | None = None,
    ) -> list[dict[str, Any]]:
        """Log one finished batch; returns per row its generated ``tokens`` and the fields every output row holds:
        ``prompt_tokens``, ``generated_tokens``, ``capacity`` (C, mean over layers and KV heads), ``budget_tokens``
        (the length the budget applied to), ``kv_entries`` (KV entries kept, summed over layers and heads),
        ``evicted_tokens`` (the tokens let go per KV head, mean over the layers that do not slide) and
        ``evicted_from`` (the generated token from which the cache had let one go, where ``decode`` watched it; None
        where it never did). ``cpu``: the batch's CPU seconds by part (:data:`PARTS`)."""
        generated = new_tokens(sequences, batch.input_ids.shape[1], ends)
        capacities = self.capacity.add(cache)
        entries = self.capacity.entries[-len(generated) :]
        gone, since = cache.evictions()
        prompts = batch.prompt_tokens
        self.rows += len(generated)
        self.prompt_tokens += sum(prompts)
        self.generated_tokens += sum(len(tokens) for tokens in generated)
        self.seconds += seconds
        for part, spent in (cpu or {}).items():
            self.cpu[part] += spent
        self.peak_entries = max(self.peak_entries, cache.peak_entries)
        self.allocated_bytes += cache.kv_bytes() * len(generated) / len(cache.lengths)
        # What a full cache would hold: the longest prompt plus every fed step (the last token is never fed).
        self.full_entries = max(self.full_entries, max(prompts) + sequences.shape[1] - batch.input_ids.shape[1] - 1)
        self.entry_bytes = cache.entry_bytes() * cache.num_layers * cache.kv_heads
        if cache.graphs is not None and cache.graphs.failed is not None:
            self.graphs_failed = cache.graphs.failed
        return [
            {
                "tokens": tokens,
                "prompt_tokens": prompt,
                "generated_tokens": len(tokens),
                "capacity": round(capacity, 2),
                "budget_tokens": budget,
                "kv_entries": round(kept),
                "evicted_tokens": evicted,
                "evicted_from": first,
            }
            for tokens, prompt, capacity, budget, kept, evicted, first in zip(
                generated, prompts, capacities, cache.lengths, entries, gone, since, strict=True
            )
        ]

    def state(self) -> dict[str, Any]:
        """What it logged, as JSON's types (:meth:`from_state` makes it again): a stopped run's, kept on disk."""
        return vars(self) | {"capacity": self.capacity.state()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> GenerationLog:
        return cls(**state | {"capacity": CapacityLog.from_state(state["capacity"])})

    def fields(self) -> dict[str, Any]:
        """The record's ``generation`` (token means, tokens/s, KV peak and full-cache entries per KV head and the
        bytes they take over all layers and heads, and the bytes of keys and values a sequence's cache allocated at
        its end, spare slots included; the CPU seconds by part, ``cpu_seconds``; where capturing a decode step
        raised, why: ``graphs_failed``, the run then decoded eagerly; where the run took up a stopped one's
        answers, ``resumed``: this cell's ``answers`` kept, its share of the CPU and wall seconds the stopped runs
        spent answering, and the commit they started from) and ``capacity``."""
        n = max(self.rows, 1)
        return {
            "generation": {
                "max_new_tokens": self.max_new_tokens,
                "prompt_tokens_mean": self.prompt_tokens / n,
                "generated_tokens_mean": self.generated_tokens / n,
                "generated_tokens_per_s": self.generated_tokens / self.seconds if self.seconds else 0.0,
                "kv_peak_entries": self.peak_entries,
                "kv_peak_bytes": self.peak_entries * self.entry_bytes,
                "kv_full_entries": self.full_entries,
                "kv_full_bytes": self.full_entries * self.entry_bytes,
                "kv_allocated_bytes_mean": self.allocated_bytes / n,
                "cpu_seconds": {part: round(spent, 3) for part, spent in self.cpu.items()},
            }
            | ({} if self.graphs_failed is None else {"graphs_failed": self.graphs_failed})
            | ({} if self.resumed is None else {"resumed": self.resumed}),
            "capacity": self.capacity.stats(),
        }
