"""The one path of a batch through a cache: feed, compress, decode (:func:`complete`), and a fresh cache's run of it
(:func:`generate`, :func:`run_batch`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from h2o_eval.cache import EvictionCache
from h2o_eval.generation.batches import Batch, end_tokens
from h2o_eval.generation.log import GenerationLog, cpu_into, cpu_parts
from h2o_eval.generation.passes import decode, decode_leaving, feed, settle
from h2o_eval.policies import Interval, Policy


def complete(
    model: Any,
    cache: EvictionCache,
    batch: Batch,
    tokenizer: Any,
    answered: dict[Any, list[list[int]]] | None = None,
    generate: Callable[..., torch.Tensor] | None = None,
    cpu: dict[str, float] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The one path of a batch through a cache: feed, compress, decode. ``cache`` is empty or already holds what
    precedes the batch's unseen columns (a shared prompt pass).

    Under ``protocol=context`` the context columns are fed first and compressed before the question exists. A
    policy that scores its prompt by extra passes runs them before the compression (:func:`settle`); under
    ``prefill`` the prompt's forward also gives the first new token (or the batch brings it, ``generated``), the
    rest follows the compression. ``generate(ids, mask, **kwargs)`` decodes (default :func:`decode` through the
    cache; lm-eval passes its own, which stops at the task's stop sequences); ``kwargs`` are its settings, with
    ``max_new_tokens``. Returns the sequences (prompt + new tokens). ``answered``: the full cache's answers the
    oracle's passes need, kept across calls (:func:`settle`). ``cpu``: where the CPU seconds of its parts go
    (:data:`~h2o_eval.generation.log.PARTS`; the default ``generate``'s forwards only)."""
    ids, mask, width = batch.input_ids, batch.attention_mask, batch.context_width
    first = "prompt"  # the part the next generate call's first forward is
    if generate is None:

        def generate(ids: torch.Tensor, mask: torch.Tensor, **settings: Any) -> torch.Tensor:
            return decode(model, cache, ids, mask, cpu=cpu, first=first, tokenizer=tokenizer, **settings)

    if width is not None and width < ids.shape[1]:
        if cache.get_seq_length() == 0:
            with cpu_into(cpu, "prompt"):
                feed(model, cache, ids[:, :width], mask[:, :width])
        questions = ids[:, width:].tolist()
        with cpu_into(cpu, "scoring"):
            settle(model, cache, tokenizer, ids[:, :width], mask[:, :width], questions, answered=answered, **kwargs)
        first = "question"
        return generate(ids, mask, **kwargs)
    if not cache.deferred and not batch.generated:
        return generate(ids, mask, **kwargs)
    prompt = ids.shape[1] - batch.generated
    if not batch.generated:  # the prompt's forward, held whole, gives the first token
        ids = generate(ids, mask, **_part(kwargs, 0, 1))
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], ids.shape[1] - prompt)], dim=-1)
    rows = [[] for _ in range(ids.shape[0])]
    with cpu_into(cpu, "scoring"):
        settle(model, cache, tokenizer, ids[:, :prompt], mask[:, :prompt], rows, answered=answered, **kwargs)
    first = "decoding"
    done = ids.shape[1] - prompt
    rest = (kwargs.get("max_new_tokens") or 1) - done
    return ids if rest <= 0 else generate(ids, mask, **_part(kwargs, done, rest))


def _part(kwargs: dict[str, Any], done: int, steps: int) -> dict[str, Any]:
    """The settings of ``steps`` more tokens after ``done``: ``max_new_tokens`` is ``steps``, and a
    ``min_new_tokens`` counts what is left of it, so that ``generate`` is never asked for more than it may give."""
    part = kwargs | {"max_new_tokens": steps}
    if kwargs.get("min_new_tokens"):
        part["min_new_tokens"] = max(0, min(kwargs["min_new_tokens"] - done, steps))
    return part


def generate(
    model: Any,
    policy: Policy,
    batch: Batch,
    tokenizer: Any,
    *,
    protocol: str,
    kernels: str,
    decoding: str = "evict",
    graphs: bool | str = True,
    interval: Interval | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, EvictionCache]:
    """Generate for a batch through a fresh :class:`EvictionCache` (:func:`complete`). Returns the sequences
    (prompt + new tokens) and the cache."""
    cache = EvictionCache(
        model, policy, protocol=protocol, kernels=kernels, decoding=decoding, graphs=graphs, interval=interval
    )
    return complete(model, cache, batch, tokenizer, **kwargs), cache


def run_batch(
    model: Any,
    policy: Policy,
    batch: Batch,
    log: GenerationLog,
    tokenizer: Any,
    *,
    protocol: str,
    kernels: str,
    leaving: bool = False,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`generate` one batch and log it (:meth:`GenerationLog.add`), timing the generation. ``leaving``: each
    row leaves the batch as its answer ends (:func:`~h2o_eval.generation.passes.decode_leaving`), logged with its
    cache as it then is, so that a long answer decodes alone rather than carrying the finished rows to its end."""
    began, cpu = time.perf_counter(), cpu_parts()
    if leaving:
        made = {name: kwargs.pop(name) for name in ("decoding", "graphs", "interval") if name in kwargs}
        cache = EvictionCache(model, policy, protocol=protocol, kernels=kernels, **made)
        return _leaving(model, cache, batch, log, tokenizer, began, cpu, **kwargs)
    sequences, cache = generate(model, policy, batch, tokenizer, protocol=protocol, kernels=kernels, cpu=cpu, **kwargs)
    return log.add(batch, sequences, cache, time.perf_counter() - began, end_tokens(tokenizer), cpu)


def _leaving(model, cache: EvictionCache, batch: Batch, log: GenerationLog, tokenizer, began: float, cpu, **kwargs):
    """:func:`run_batch` with ``leaving``, through ``cache``; ``began`` and ``cpu``: its start and CPU seconds."""
    ends = end_tokens(tokenizer)
    width, total, outputs = batch.input_ids.shape[1], kwargs["max_new_tokens"], {}

    def leave(rows: list[int], part: EvictionCache, sequences: torch.Tensor) -> None:
        own = Batch(batch.input_ids[rows], batch.attention_mask[rows], batch.context_width, batch.generated)
        outputs.update(zip(rows, log.add(own, sequences, part, 0.0, ends), strict=True))

    def generate_leaving(ids: torch.Tensor, mask: torch.Tensor, **settings: Any) -> torch.Tensor:
        if ids.shape[1] > width:
            first = "decoding"
        else:
            first = "question" if batch.context_width is not None and batch.context_width < width else "prompt"
        if ids.shape[1] - width + settings["max_new_tokens"] < total:  # the prompt's token before its compression
            return decode(model, cache, ids, mask, cpu=cpu, first=first, tokenizer=tokenizer, **settings)
        return decode_leaving(model, cache, ids, mask, leave, cpu=cpu, first=first, tokenizer=tokenizer, **settings)

    complete(model, cache, batch, tokenizer, generate=generate_leaving, cpu=cpu, **kwargs)
    log.seconds += time.perf_counter() - began
    for part, spent in cpu.items():
        log.cpu[part] += spent
    return [outputs[row] for row in range(len(outputs))]
