"""The one eviction mechanism: a chunk of new tokens attends to (cache state + itself) under per-step eviction.

Shapes: B sequences, Hq query heads over Hkv KV heads (G = Hq / Hkv per group, query head h*G+g belongs to KV
head h), n new tokens, N = S + n slots (S state slots followed by the n new tokens), D head dim.

A chunk has up to two phases per sequence. Its first ``prefill`` rows are the **prompt** (only on an empty
cache): they attend in full, causally; their votes (the policy :class:`~h2o_eval.policies.Rule`'s
``prompt_weights``) feed the scores; after the last real prompt row the cache is **compressed** to C
(:func:`compress`). Every later row is a **decode** row and, per (sequence, KV head), does in order:

1. if the cache already holds C tokens, evict the held token that is neither among the ``recent`` most recent
   (positions > t - recent, the current token counting as the newest) nor among the first ``sinks``, with the
   lowest score; ties go to the smallest position. It never returns. (A rule that ``grows`` has C unbounded
   after its prompt: nothing is evicted.)
2. the token enters the cache, and its queries attend to exactly the held tokens (softmax renormalised over them);
3. the rule's ``decode_votes`` fold that attention, summed over the group's query heads, into the scores:
   added, replacing the previous ones, or not at all.

A rule with a ``threshold`` compresses the prompt by it instead of C: every unprotected token scoring below it goes.
One that also ``drops`` does so again at the end of every later forward, a step of the cache's layer
(:func:`h2o_eval.decode.drop`), not of a chunk.

Padding tokens (``arriving`` False) never enter. Scores start as the policy's ``key_scores`` (or 0).
simulate = empty state, no prompt rows; prefill/context = the context's rows are prompt rows; decode = chunks
of one token. :func:`attend_chunk_reference` states all of this as a plain loop over rows, one eviction at a time:
the definition every implementation is tested against. The implementations: :mod:`h2o_eval.chunks` (a chunk of
any length, fast), :mod:`h2o_eval.compression` (a prompt compressed to C at once) and :mod:`h2o_eval.decode` (one
token per sequence into static buffers, the step a CUDA graph replays).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from h2o_eval.kernels.reference import grouped_logits
from h2o_eval.policies import UNBOUNDED, Rule
from h2o_eval.policies.base import Combine, DecodeVote, Heads, Pooling


@dataclass
class Chunk:
    """Everything but q/k/v that one chunk's attention needs.

    held: [B, Hkv, N] bool, state slots held at the start (new slots False).
    arriving: [B, n] bool, new tokens that are real (False for padding).
    position: [B, Hkv, N] int64, each slot's token index in its sequence (padding excluded).
    scores: [B, Hkv, N] float32, the state slots' scores and the new tokens' starting scores.
    capacity: [B, Hkv] int64, C per sequence and KV head (this layer's).
    recent, sinks, prefill: [B] int64; rows < ``prefill`` are prompt rows (only with an empty state).
    rule: the policy's score rule.
    output: False when the caller computes the prompt rows' attention itself (:class:`h2o_eval.groups.SharedPrompt`):
    they then only vote: a chunk of prompt rows alone has no output (None), and beside other rows theirs is zero.
    rescore: when the prompt is compressed, the policy's own scores from its pooled ones: ``rescore(scores,
    protected)`` with scores and the protected tokens [B, Hkv, N] -> scores [B, Hkv, N] (None: as they are).
    votes: the prompt votes already computed from the same query, keys and values (one :class:`SharedPrompt`
    layer's pass), as (row weights, rows, votes); a chunk without output whose weights and rows are one of these
    takes its votes instead of computing them, and adds its own (None: no sharing).
    """

    held: torch.Tensor
    arriving: torch.Tensor
    position: torch.Tensor
    scores: torch.Tensor
    capacity: torch.Tensor
    recent: torch.Tensor
    sinks: torch.Tensor
    prefill: torch.Tensor
    rule: Rule
    scaling: float
    output: bool = True
    rescore: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    votes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


@dataclass
class Result:
    """A chunk's output [B, Hq, n, D] (None: prompt rows alone, without :attr:`Chunk.output`) and the cache state
    after it: held, scores [B, Hkv, N] and the capacities [B, Hkv] that now apply (compression can make them per
    head, or unbounded); ``kept`` [B, Hkv]: the tokens each head held right after its prompt was compressed (None
    without prompt rows)."""

    output: torch.Tensor | None
    held: torch.Tensor
    scores: torch.Tensor
    capacity: torch.Tensor
    kept: torch.Tensor | None = None


def prompt_rows(chunk: Chunk, n: int) -> torch.Tensor:
    """[B, n] bool: the real rows of each sequence's prompt."""
    rows = torch.arange(n, device=chunk.arriving.device)
    return chunk.arriving & (rows < chunk.prefill.view(-1, 1))


def share_votes(attention: torch.Tensor, rule: Rule) -> torch.Tensor:
    """Votes [B, Hkv, N] (each KV head's query heads summed) as the rule hands them to the KV heads: as they are,
    or with ``heads="layer"`` the layer's sum, the same for every head."""
    if rule.heads == Heads.LAYER:
        return attention.sum(1, keepdim=True).expand_as(attention)
    return attention


def lowest(scores: torch.Tensor, position: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Index of the candidate with the lowest score, the smallest position among equal scores."""
    best = scores.masked_fill(~candidate, float("inf")).amin(-1, keepdim=True)
    tied = candidate & (scores == best)
    return position.masked_fill(~tied, torch.iinfo(torch.int64).max).argmin(-1)


def protected_slots(
    position: torch.Tensor, now: torch.Tensor, recent: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """[B, Hkv, N] bool: positions among the ``recent`` newest up to ``now`` [B], or among the first ``sinks``."""
    return (position > (now - recent).view(-1, 1, 1)) | (position < sinks.view(-1, 1, 1))


def attend_chunk_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: Chunk) -> Result:
    """The semantics above as a loop over rows, one eviction at a time (the definition the fast paths are
    tested against; compression too is written here as repeated single evictions)."""
    batch, q_heads, n, _ = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    state = slots - n
    rule = chunk.rule
    logits = grouped_logits(query, key, chunk.scaling)
    held = chunk.held.clone()
    scores = chunk.scores.clone().float()
    position = chunk.position
    capacity = chunk.capacity.clone()
    output = torch.zeros(batch, kv_heads, group, n, value.shape[-1], dtype=torch.float32, device=query.device)
    in_prompt = prompt_rows(chunk, n)
    if bool(in_prompt.any()) and state:
        raise ValueError("prompt rows need an empty cache: prefill a chunk before any other")
    prompt_weights = rule.prompt_weights(in_prompt)
    last_prompt_row = torch.where(
        in_prompt.any(-1), (in_prompt * torch.arange(1, n + 1, device=query.device)).amax(-1) - 1, -1
    )
    kept = None

    def evict_one(where: torch.Tensor, now: torch.Tensor) -> None:
        candidate = held & ~protected_slots(position, now, chunk.recent, chunk.sinks)
        if bool((where & ~candidate.any(-1)).any()):
            raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")
        victim = lowest(scores, position, candidate)
        held.scatter_(-1, victim.unsqueeze(-1), held.gather(-1, victim.unsqueeze(-1)) & ~where.unsqueeze(-1))

    for row in range(n):
        slot = state + row
        arrives = chunk.arriving[:, row].view(-1, 1).expand(batch, kv_heads)
        now = position[:, 0, slot]
        decoding = arrives & ~in_prompt[:, row].view(-1, 1)
        evict_one(decoding & (held.sum(-1) >= capacity), now)
        held[..., slot] |= arrives
        masked = logits[:, :, :, row].masked_fill(~held.unsqueeze(2), float("-inf"))
        probs = torch.softmax(masked, dim=-1).nan_to_num(0.0) * arrives.view(batch, kv_heads, 1, 1)
        output[:, :, :, row] = torch.matmul(probs, value.float())
        attention = share_votes(probs.sum(2), rule)
        if prompt_weights is not None:
            weight = torch.where(in_prompt[:, row], prompt_weights[:, row], float(rule.decode_votes != DecodeVote.NONE))
        else:
            weight = torch.zeros(batch, device=query.device)
        votes = arrives & (weight > 0).view(-1, 1)
        if rule.combine == Combine.REPLACE:
            scores = torch.where(votes.unsqueeze(-1), attention, scores)
        else:
            scores = scores + attention * (weight.view(-1, 1, 1) * votes.unsqueeze(-1))
        compressing = last_prompt_row == row
        if bool(compressing.any()):
            scores = _reference_compress(held, scores, position, capacity, chunk, now, compressing)
            kept = torch.where(compressing.view(-1, 1), held.sum(-1), 0 if kept is None else kept)
            if rule.grows:
                capacity = torch.where(compressing.view(-1, 1), UNBOUNDED, capacity)
            elif rule.safeguard is not None:
                capacity = torch.where(compressing.view(-1, 1), held.sum(-1), capacity)
    return Result(output.view(batch, q_heads, n, -1).to(query.dtype), held, scores, capacity, kept)


def _reference_compress(held, scores, position, capacity, chunk, now, compressing) -> torch.Tensor:
    """Compression written as single evictions (in place on ``held``); returns the pooled scores."""
    rule = chunk.rule
    batch, kv_heads, slots = held.shape
    protected = protected_slots(position, now, chunk.recent, chunk.sinks)
    older = held & (position <= (now - chunk.recent).view(-1, 1, 1)) & compressing.view(-1, 1, 1)
    if rule.pooling is not None:
        pool = torch.nn.functional.max_pool1d if rule.pooling == Pooling.MAX else torch.nn.functional.avg_pool1d
        for b, h in zip(*torch.nonzero(older.any(-1), as_tuple=True), strict=True):
            where = torch.nonzero(older[b, h]).flatten()  # slot order is position order on a prompt
            row = scores[b, h, where].view(1, 1, -1)
            pooled = pool(row, rule.kernel_size, stride=1, padding=rule.kernel_size // 2)
            scores[b, h, where] = pooled.flatten()
    if chunk.rescore is not None:
        active = compressing.view(-1, 1, 1)
        scores = torch.where(active, chunk.rescore(scores, protected & held & active), scores)
    for b in torch.nonzero(compressing).flatten().tolist():
        if rule.threshold is not None:
            for h in range(kv_heads):
                below = held[b, h] & ~protected[b, h] & (scores[b, h] < rule.threshold)
                while bool(below.any()):
                    victim = lowest(scores[b, h], position[b, h], below)
                    held[b, h, victim] = below[victim] = False
            continue
        if rule.safeguard is None:
            for h in range(kv_heads):
                while int(held[b, h].sum()) > int(capacity[b, h]):
                    candidate = held[b, h] & ~protected[b, h]
                    held[b, h, lowest(scores[b, h], position[b, h], candidate)] = False
            continue
        sure = torch.zeros(kv_heads, slots, dtype=torch.bool, device=held.device)
        for h in range(kv_heads):
            candidate = held[b, h] & ~protected[b, h]
            room = int(capacity[b, h]) - int((held[b, h] & protected[b, h]).sum())
            count = min(room, int(rule.safeguard * int(capacity[b, h])) - int((held[b, h] & protected[b, h]).sum()))
            best = sorted(
                torch.nonzero(candidate).flatten().tolist(), key=lambda j: (-scores[b, h, j], -position[b, h, j])
            )
            sure[h, best[: max(count, 0)]] = True
        while int(held[b].sum()) > int(capacity[b].sum()):
            rest = held[b] & ~protected[b] & ~sure
            victims = [(float(scores[b, h, j]), int(position[b, h, j]), h, j) for h, j in torch.nonzero(rest).tolist()]
            _, _, h, j = min(victims)
            held[b, h, j] = False
    return scores
