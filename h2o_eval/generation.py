"""The one generation path every runner uses: a batch of prompts in, an :class:`~h2o_eval.cache.EvictionCache`
filled (the context compressed before the question under ``protocol=context``), ``generate()``, and per-row
outputs and record fields that read the same for every task.

A prompt is two token-id parts, ``context`` and ``question``. Under ``protocol=context`` the contexts are fed as
one chunk and compressed before any question token exists; every question of a batch has one length, so that
all contexts end in one column. Under the other protocols the prompt is whole (its question may be empty).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from h2o_eval.cache import EvictionCache
from h2o_eval.capacity import CapacityLog
from h2o_eval.groups import SharedPrompt
from h2o_eval.policies import Full, Policy
from h2o_eval.policies.inputs import Script


@dataclass
class Batch:
    """Left-padded prompts: ``input_ids`` and ``attention_mask`` [B, T]; ``context_width``: under
    ``protocol=context``, the columns of the contexts (fed and compressed first), else None; ``generated``: how
    many of the last columns were already generated from the prompt before it (a shared prompt pass gives every
    cache the same first token)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    context_width: int | None = None
    generated: int = 0

    @property
    def prompt_tokens(self) -> list[int]:
        return self.attention_mask[:, : self.attention_mask.shape[1] - self.generated].sum(-1).tolist()


def make_batch(contexts: list[list[int]], questions: list[list[int]], pad: int, device: Any, *, split: bool) -> Batch:
    """One batch of token-id prompts, left-padded with ``pad``. ``split`` (protocol=context): every context ends in
    one column and the questions, all of one length, follow; otherwise each prompt is context + question."""
    if split:
        if len({len(q) for q in questions}) != 1:
            raise ValueError("a context-protocol batch needs questions of one length: batch them by length")
        width = max(len(c) for c in contexts)
        rows = [[pad] * (width - len(c)) + c + q for c, q in zip(contexts, questions, strict=True)]
        mask = [[0] * (width - len(c)) + [1] * (len(c) + len(q)) for c, q in zip(contexts, questions, strict=True)]
        return Batch(torch.tensor(rows, device=device), torch.tensor(mask, device=device), width)
    prompts = [c + q for c, q in zip(contexts, questions, strict=True)]
    width = max(len(p) for p in prompts)
    rows = [[pad] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return Batch(torch.tensor(rows, device=device), torch.tensor(mask, device=device))


def feed(model: Any, cache: EvictionCache | SharedPrompt, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Feed left-padded token columns through ``cache`` as one chunk (an empty cache prefills and compresses them);
    their logits are never read."""
    with torch.no_grad():
        model(
            input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
            cache=cache,
        )


def decode(model: Any, cache: EvictionCache, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any):
    """``model.generate`` through ``cache`` (already fed whatever precedes ``input_ids``' unseen columns)."""
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache, **kwargs)


def greedy(max_new_tokens: int, pad_token_id: int | None, **extra: Any) -> dict[str, Any]:
    """``generate``'s settings for ``max_new_tokens`` greedy tokens (and ``extra``): the model's sampling defaults
    (temperature, top-p, top-k) unset, so that transformers does not warn that greedy decoding ignores them."""
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "pad_token_id": pad_token_id,
        **extra,
    }


def answers(model: Any, ids: torch.Tensor, mask: torch.Tensor, tokenizer: Any, **kwargs: Any) -> list[list[int]]:
    """The full cache's answers to left-padded prompts (each row's generated tokens, :func:`new_tokens`)."""
    full = EvictionCache(model, Full(), protocol="prefill")
    sequences = decode(model, full, ids, mask, tokenizer=tokenizer, **kwargs)
    return new_tokens(sequences, ids.shape[1], end_tokens(tokenizer))


def settle(
    model: Any,
    cache: EvictionCache,
    tokenizer: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    questions: list[list[int]],
    siblings: Sequence[EvictionCache] = (),
    answered: dict[Any, list[list[int]]] | None = None,
    **kwargs: Any,
) -> None:
    """After a cache's first chunk (``ids``/``mask``, left-padded): a policy that scores its prompt by extra passes
    (:meth:`~h2o_eval.policies.Policy.passes`) runs them now, each fed through the cache (positions after each
    row's chunk, shorter passes padded at their end) and dropped again, and the prompt is then compressed.
    Nothing to do for any other policy (it compressed its prompt as it came). ``questions``: per row the tokens
    that follow the chunk (protocol=context), or none. A policy whose passes need the full cache's answer (the
    oracle) has it generated first, greedily like the evaluation (``kwargs``): under ``protocol=context`` from a
    copy of the cache, which still holds the whole context (:meth:`~h2o_eval.cache.EvictionCache.full_copy`), so
    the answer is exactly the full cache's in the same evaluation; under ``prefill`` by a full cache fed the
    prompt. It is generated once per prompt and settings when the caller keeps the answers in ``answered`` (one
    dict for the oracle's cells at several budgets: the same prompts, the same answers). ``siblings``: caches
    holding the same chunk under the same policy at other budgets; they take the passes' scores
    (:meth:`~h2o_eval.cache.EvictionCache.adopt_rehearsal`) instead of running them, and are compressed too."""
    if not cache.deferred:
        return
    rows = [ids[r][mask[r].bool()].tolist() for r in range(ids.shape[0])]
    answer = None
    if cache.policy.needs_answer:
        asked = torch.tensor(questions, dtype=ids.dtype, device=ids.device).view(ids.shape[0], -1)
        prompt = torch.cat([ids, asked], 1)
        prompt_mask = torch.cat([mask, torch.ones_like(asked, dtype=mask.dtype)], 1)
        key = answer_key(prompt, prompt_mask, **kwargs)
        answer = None if answered is None else answered.get(key)
        if answer is None and cache.protocol == "context":  # the full cache's state after this context: a copy
            full = decode(model, cache.full_copy(), prompt, prompt_mask, tokenizer=tokenizer, **kwargs)
            answer = new_tokens(full, prompt.shape[1], end_tokens(tokenizer))
        elif answer is None:
            answer = answers(model, prompt, prompt_mask, tokenizer, **kwargs)
        if answered is not None:
            answered[key] = answer
    script = Script(rows, [list(q) for q in questions], answer, tokenizer)
    pad = tokenizer.pad_token_id
    for index, tokens in enumerate(cache.policy.passes(script)):
        width = max(len(t) for t in tokens)
        if width == 0:
            continue
        extra = torch.tensor([t + [pad] * (width - len(t)) for t in tokens], device=ids.device)
        extra_mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in tokens], device=ids.device)
        positions = mask.sum(-1, keepdim=True) + torch.arange(width, device=ids.device)
        with torch.no_grad(), cache.rehearsal(index, script):
            model(
                extra,
                attention_mask=torch.cat([mask, extra_mask.to(mask.dtype)], 1),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                cache=cache,
            )
    for sibling in siblings:
        sibling.adopt_rehearsal(cache)
        sibling.compress_prompt()
    cache.compress_prompt()


def compress(
    model: Any,
    cache: EvictionCache,
    tokenizer: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    questions: list[list[int]] | None = None,
    **generate_kwargs: Any,
) -> None:
    """Compress the prompt ``cache`` was fed (``input_ids``, left-padded as ``attention_mask`` says) by its policy's
    extra passes: KVzip's repeat of the context, the oracle's question and full-cache answer. They run through
    ``model`` now, their own keys and values are dropped, and each KV head keeps its C. Any other policy compressed
    its prompt as it came: nothing happens. ``questions``: per sequence the question's token ids (the oracle's
    passes need them; under ``protocol="context"`` they come after the compressed context); ``generate_kwargs``:
    how the full-cache answer is generated (greedy by default)."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    asked = [[] for _ in range(input_ids.shape[0])] if questions is None else questions
    settle(model, cache, tokenizer, input_ids, mask, asked, **({"do_sample": False} | generate_kwargs))


def answer_key(prompt: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> tuple:
    """What identifies the full cache's answers to a batch of prompts (``prompt``/``mask``, the context and the
    question) generated with the settings ``kwargs``, in :func:`settle`'s ``answered``."""
    return tuple(prompt.shape), prompt.cpu().numpy().tobytes(), mask.cpu().numpy().tobytes(), repr(kwargs)


def complete(
    model: Any,
    cache: EvictionCache,
    batch: Batch,
    tokenizer: Any,
    answered: dict[Any, list[list[int]]] | None = None,
    generate: Callable[..., torch.Tensor] | None = None,
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
    oracle's passes need, kept across calls (:func:`settle`)."""
    ids, mask, width = batch.input_ids, batch.attention_mask, batch.context_width
    if generate is None:

        def generate(ids: torch.Tensor, mask: torch.Tensor, **settings: Any) -> torch.Tensor:
            return decode(model, cache, ids, mask, tokenizer=tokenizer, **settings)

    if width is not None and width < ids.shape[1]:
        if cache.get_seq_length() == 0:
            feed(model, cache, ids[:, :width], mask[:, :width])
        questions = ids[:, width:].tolist()
        settle(model, cache, tokenizer, ids[:, :width], mask[:, :width], questions, answered=answered, **kwargs)
        return generate(ids, mask, **kwargs)
    if not cache.deferred and not batch.generated:
        return generate(ids, mask, **kwargs)
    prompt = ids.shape[1] - batch.generated
    if not batch.generated:  # the prompt's forward, held whole, gives the first token
        ids = generate(ids, mask, **_part(kwargs, 0, 1))
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], ids.shape[1] - prompt)], dim=-1)
    rows = [[] for _ in range(ids.shape[0])]
    settle(model, cache, tokenizer, ids[:, :prompt], mask[:, :prompt], rows, answered=answered, **kwargs)
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
    graphs: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, EvictionCache]:
    """Generate for a batch through a fresh :class:`EvictionCache` (:func:`complete`). Returns the sequences
    (prompt + new tokens) and the cache."""
    cache = EvictionCache(model, policy, protocol=protocol, kernels=kernels, decoding=decoding, graphs=graphs)
    return complete(model, cache, batch, tokenizer, **kwargs), cache


def new_tokens(sequences: torch.Tensor, prompt_width: int, ends: set[int]) -> list[list[int]]:
    """Each row's generated tokens, up to (not including) the first end token (end of sequence, or the padding
    ``generate`` puts after a finished row): the one way generated tokens are counted."""
    rows = []
    for tokens in sequences[:, prompt_width:].tolist():
        length = next((i for i, token in enumerate(tokens) if token in ends), len(tokens))
        rows.append(tokens[:length])
    return rows


def steps(model: Any, sequences: torch.Tensor, prompt_width: int) -> int:
    """The steps ``generate`` takes to give these rows alone (when they were generated in a larger batch): until
    every row has generated an end of sequence (the model's ``generation_config``), at most all of them."""
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else set() if eos is None else {eos}
    rows = sequences[:, prompt_width:].tolist()
    return max(next((i + 1 for i, token in enumerate(row) if token in eos), len(row)) for row in rows)


def end_tokens(tokenizer: Any) -> set[int]:
    return {token for token in (tokenizer.eos_token_id, tokenizer.pad_token_id) if token is not None}


class Progress:
    """A progress bar over a run's units (documents, questions) that also says once, after the first batch, about
    how long the rest will take (a line in a log, where the bar's own estimate is overwritten)."""

    def __init__(self, total: int, description: str, unit: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=description, unit=unit)
        self.total, self.description, self.unit = total, description, unit
        self.began = time.perf_counter()
        self.told = False

    def update(self, count: int) -> None:
        self.bar.update(count)
        done = self.bar.n
        if not self.told and 0 < done < self.total:
            elapsed = time.perf_counter() - self.began
            left = elapsed / done * (self.total - done)
            self.bar.write(
                f"{self.description}: ~{max(left / 60, 1):.0f} min left ({done} of {self.total} {self.unit}s in "
                f"{elapsed:.0f} s)",
                file=sys.stderr,
            )
            self.told = True

    def close(self) -> None:
        self.bar.close()


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
    full_entries: int = 0
    entry_bytes: int = 0

    def add(
        self, batch: Batch, sequences: torch.Tensor, cache: EvictionCache, seconds: float, ends: set[int]
    ) -> list[dict[str, Any]]:
        """Log one finished batch; returns per row its generated ``tokens`` and the fields every output row holds:
        ``prompt_tokens``, ``generated_tokens``, ``capacity`` (C, mean over layers and KV heads), ``budget_tokens``
        (the length the budget applied to) and ``kv_entries`` (KV entries kept, summed over layers and heads)."""
        generated = new_tokens(sequences, batch.input_ids.shape[1], ends)
        capacities = self.capacity.add(cache)
        entries = self.capacity.entries[-len(generated) :]
        prompts = batch.prompt_tokens
        self.rows += len(generated)
        self.prompt_tokens += sum(prompts)
        self.generated_tokens += sum(len(tokens) for tokens in generated)
        self.seconds += seconds
        self.peak_entries = max(self.peak_entries, cache.peak_entries)
        # What a full cache would hold: the longest prompt plus every fed step (the last token is never fed).
        self.full_entries = max(self.full_entries, max(prompts) + sequences.shape[1] - batch.input_ids.shape[1] - 1)
        self.entry_bytes = cache.entry_bytes() * cache.num_layers * cache.kv_heads
        return [
            {
                "tokens": tokens,
                "prompt_tokens": prompt,
                "generated_tokens": len(tokens),
                "capacity": round(capacity, 2),
                "budget_tokens": budget,
                "kv_entries": round(kept),
            }
            for tokens, prompt, capacity, budget, kept in zip(
                generated, prompts, capacities, cache.lengths, entries, strict=True
            )
        ]

    def fields(self) -> dict[str, Any]:
        """The record's ``generation`` (token means, tokens/s, KV peak and full-cache entries per KV head and the
        bytes they take over all layers and heads) and ``capacity``."""
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
            },
            "capacity": self.capacity.stats(),
        }


def run_batch(
    model: Any,
    policy: Policy,
    batch: Batch,
    log: GenerationLog,
    tokenizer: Any,
    *,
    protocol: str,
    kernels: str,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`generate` one batch and log it (:meth:`GenerationLog.add`), timing the generation."""
    began = time.perf_counter()
    sequences, cache = generate(model, policy, batch, tokenizer, protocol=protocol, kernels=kernels, **kwargs)
    return log.add(batch, sequences, cache, time.perf_counter() - began, end_tokens(tokenizer))
