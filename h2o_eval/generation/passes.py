"""Feeding a cache and running a policy's extra passes: a prompt fed as one chunk, ``generate`` through a cache,
and the passes (KVzip's repeat, the oracle's question and full-cache answer) that score a deferred prompt before it
is compressed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from h2o_eval.cache import EvictionCache
from h2o_eval.generation.batches import end_tokens, eos_tokens, new_tokens
from h2o_eval.generation.log import forwards_into
from h2o_eval.groups import SharedPrompt
from h2o_eval.policies import Full
from h2o_eval.policies.inputs import Script


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


def decode(
    model: Any,
    cache: EvictionCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cpu: dict[str, float] | None = None,
    first: str = "question",
    watch: bool = False,
    **kwargs: Any,
):
    """``model.generate`` through ``cache`` (already fed whatever precedes ``input_ids``' unseen columns); its
    forwards' CPU seconds go to ``cpu`` (:func:`~h2o_eval.generation.log.forwards_into`: the first to ``first``).
    ``watch``: after each forward the cache notes which sequences have let a token go
    (:meth:`~h2o_eval.cache.EvictionCache.note_evictions`), a few reductions on the device per forward."""
    with torch.no_grad(), forwards_into(model, cpu, first), watching(model, cache if watch else None):
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache, **kwargs)


@contextlib.contextmanager
def watching(model: Any, cache: EvictionCache | None) -> Iterator[None]:
    """Within the block, ``cache`` notes its evictions after every forward of ``model`` (nothing where it is
    None)."""
    if cache is None:
        yield
        return
    handle = model.register_forward_hook(lambda module, args, output: cache.note_evictions())
    try:
        yield
    finally:
        handle.remove()


class _RowEnds(StoppingCriteria):
    """Which rows have ended: their last token is an end of sequence, or their text ends in a stop string
    (``stops``: transformers' ``StopStringCriteria``); as a stopping criterion (``any_row``), every row stops as soon
    as one has ended."""

    def __init__(self, ends: set[int], device: torch.device, stops: StoppingCriteria | None, any_row: bool) -> None:
        self.ends, self.stops, self.any_row = torch.tensor(sorted(ends), device=device), stops, any_row

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        ended = torch.isin(input_ids[:, -1], self.ends)
        if self.stops is not None:
            ended |= self.stops(input_ids, scores)
        return ended.any().expand(input_ids.shape[0]).clone() if self.any_row else ended


def decode_leaving(
    model: Any,
    cache: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    leave: Callable[[list[int], Any, torch.Tensor], None] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """:func:`decode` through a cache whose rows leave the batch as their answers end: ``generate`` stops whenever a
    row generates an end of sequence (the model's), the cache keeps the other rows (``cache.rows``: a stack's
    :meth:`~h2o_eval.groups.StackedCache.rows`, an :meth:`~h2o_eval.cache.EvictionCache.rows`) and ``generate`` goes
    on for them. ``leave(rows, cache, sequences)``, where given, is told of the rows (indices into ``input_ids``) as
    they leave, with a cache of theirs alone as it is then and their sequences; the last rows with the cache itself.
    ``stop_strings`` (with ``tokenizer``): a row whose text ends in one of them has ended too. Returns what
    :func:`decode` returns: the rows' sequences, a row that ended padded after it with ``pad_token_id``."""
    ends = eos_tokens(model)
    width, total, pad = input_ids.shape[1], kwargs["max_new_tokens"], kwargs.get("pad_token_id")
    rows, done = list(range(input_ids.shape[0])), {}
    strings = kwargs.pop("stop_strings", None)
    stops = StopStringCriteria(kwargs["tokenizer"], strings) if strings else None
    ended_rows = _RowEnds(ends, input_ids.device, stops, any_row=False)
    stop = StoppingCriteriaList([_RowEnds(ends, input_ids.device, stops, any_row=True)]) if ends or stops else None
    ids, mask = input_ids, attention_mask
    while True:
        left = total - (ids.shape[1] - width)
        ids = decode(model, cache, ids, mask, stopping_criteria=stop, **kwargs | {"max_new_tokens": left})
        kwargs["first"] = "decoding"
        ended = ended_rows(ids, None).nonzero().flatten().tolist() if ids.shape[1] > width else []
        if ids.shape[1] - width >= total or not ended or len(ended) == len(rows):
            done |= dict(zip(rows, ids[:, width:], strict=True))
            if leave is not None:
                leave(rows, cache, ids)
            break
        done |= {rows[j]: ids[j, width:] for j in ended}
        if leave is not None:
            leave([rows[j] for j in ended], cache.rows(ended), ids[ended])
        keep = [j for j in range(len(rows)) if j not in ended]
        cache, rows, ids = cache.rows(keep), [rows[j] for j in keep], ids[keep]
        mask = torch.cat([mask[keep], mask.new_ones(len(keep), ids.shape[1] - mask.shape[1])], dim=-1)
    longest = max(len(tokens) for tokens in done.values())
    sequences = input_ids.new_full((input_ids.shape[0], width + longest), pad if pad is not None else 0)
    sequences[:, :width] = input_ids
    for row, tokens in done.items():
        sequences[row, width : width + len(tokens)] = tokens
    return sequences


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
