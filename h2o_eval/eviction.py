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

Padding tokens (``arriving`` False) never enter. Scores start as the policy's ``key_scores`` (or 0).
simulate = empty state, no prompt rows; prefill/context = the context's rows are prompt rows; decode = chunks
of one token. :func:`attend_chunk_reference` states all of this as a plain loop over rows; :func:`attend_chunk`
is the fast path: the prompt phase as fused attention plus one pass of column sums (``prompt_votes``, Triton on
CUDA), :func:`compress` vectorised, and the decode phase as the numba-compiled row scan over blocks of rows
(the Triton ``eviction_scan`` on CUDA), or plain masked attention when no row can evict and none votes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from h2o_eval.kernels.numba_scan import scan_rows
from h2o_eval.kernels.prompt import prompt_votes
from h2o_eval.kernels.reference import (
    decode_attention_reference,
    grouped_logits,
    grouped_values,
    visible,
)
from h2o_eval.policies import UNBOUNDED, Rule
from h2o_eval.policies.base import Combine, DecodeVote, Heads, Pooling

ROW_BLOCK = 256  # decode-phase rows per block on the CPU: memory grows as rows x slots, never n x N


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
    they then only vote, and their output is left zero.
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
    """A chunk's output [B, Hq, n, D] and the cache state after it: held, scores [B, Hkv, N] and the
    capacities [B, Hkv] that now apply (compression can make them per head, or unbounded); ``kept`` [B, Hkv]:
    the tokens each head held right after its prompt was compressed (None without prompt rows)."""

    output: torch.Tensor
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


def _lowest(scores: torch.Tensor, position: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Index of the candidate with the lowest score, the smallest position among equal scores."""
    best = scores.masked_fill(~candidate, float("inf")).amin(-1, keepdim=True)
    tied = candidate & (scores == best)
    return position.masked_fill(~tied, torch.iinfo(torch.int64).max).argmin(-1)


def _protected(position: torch.Tensor, now: torch.Tensor, recent: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, N] bool: positions among the ``recent`` newest up to ``now`` [B], or among the first ``sinks``."""
    return (position > (now - recent).view(-1, 1, 1)) | (position < sinks.view(-1, 1, 1))


def pool_scores(scores: torch.Tensor, domain: torch.Tensor, rule: Rule) -> torch.Tensor:
    """The scores with those in ``domain`` [B, Hkv, N] pooled along positions, as torch's ``max_pool1d`` /
    ``avg_pool1d`` (stride 1, padding kernel_size // 2, avg counting the padding) would pool each (sequence, KV
    head)'s domain scores laid out in slot order, which on a prompt is position order."""
    if rule.pooling is None or not bool(domain.any()):
        return scores
    batch, kv_heads, _ = scores.shape
    length = int(domain.sum(-1).max())
    index = torch.where(domain, domain.cumsum(-1) - 1, length)  # rank in the domain; elsewhere a spare column
    fill = float("-inf") if rule.pooling == Pooling.MAX else 0.0  # what torch pads with
    dense = torch.full((batch, kv_heads, length + 1), fill, dtype=torch.float32, device=scores.device)
    dense = dense.scatter(-1, index, scores.float())[..., :length]
    dense = torch.where(torch.arange(length, device=scores.device) < domain.sum(-1, keepdim=True), dense, fill)
    pool = torch.nn.functional.max_pool1d if rule.pooling == Pooling.MAX else torch.nn.functional.avg_pool1d
    pooled = pool(dense.reshape(batch * kv_heads, 1, length), rule.kernel_size, stride=1, padding=rule.kernel_size // 2)
    pooled = pooled.view(batch, kv_heads, length).gather(-1, index.clamp(max=length - 1))
    return torch.where(domain, pooled, scores)


def compress(
    held: torch.Tensor,
    scores: torch.Tensor,
    position: torch.Tensor,
    capacity: torch.Tensor,
    recent: torch.Tensor,
    sinks: torch.Tensor,
    now: torch.Tensor,
    rule: Rule,
    rescore: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress a prompt's cache to its capacity; returns (held, scores, capacity after the prompt).

    ``now`` [B] is the position of each sequence's last prompt token (-1: no prompt, nothing changes). The
    scores of the tokens older than the recent window are pooled (``rule.pooling``), then handed to ``rescore``
    (the policy's own scores, see :class:`Chunk`); the protected tokens stay;
    of the rest, the lowest (score, position) go until each KV head holds its C. With ``rule.safeguard`` the
    heads of the layer share their Hkv * C slots instead: each keeps its protected tokens and its
    floor(safeguard * C) best, the remaining slots go to the best of the layer (ties: lowest score, then smallest
    position, then lowest head goes first). After the prompt, C is unbounded if the rule grows, else what each
    head holds (at most its C).
    """
    batch, kv_heads, slots = scores.shape
    device = scores.device
    active = (now >= 0).view(-1, 1, 1)
    protected = _protected(position, now, recent, sinks) & held
    older = held & (position <= (now - recent).view(-1, 1, 1)) & active
    scores = pool_scores(scores, older, rule)
    if rescore is not None:
        scores = torch.where(active, rescore(scores, protected & active), scores)
    candidate = held & ~protected & active
    # Rank candidates per head, best first: higher score, then larger position (ties: the oldest goes).
    order = torch.argsort(-position, dim=-1, stable=True)
    order = order.gather(
        -1, torch.argsort((-scores).masked_fill(~candidate, torch.inf).gather(-1, order), dim=-1, stable=True)
    )
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(slots, device=device).expand_as(order))
    room = (capacity - protected.sum(-1)).clamp(min=0)  # [B, Hkv] candidates each head may keep
    if rule.safeguard is None:
        keep = candidate & (rank < room.unsqueeze(-1))
    else:
        guaranteed = torch.minimum(room, (rule.safeguard * capacity).floor().long() - protected.sum(-1))
        sure = candidate & (rank < guaranteed.clamp(min=0).unsqueeze(-1))
        shared = capacity.sum(-1) - protected.sum((-1, -2)) - sure.sum((-1, -2))  # [B] slots left in the layer
        rest = candidate & ~sure
        # Rank the rest across the layer's heads: higher score, then larger position, then higher head first.
        flat_scores = scores.masked_fill(~rest, -torch.inf).reshape(batch, -1)
        flat_position = position.reshape(batch, -1)
        head = torch.arange(kv_heads, device=device).repeat_interleave(slots).expand(batch, -1)
        flat_order = torch.argsort(-head, dim=-1, stable=True)
        for key in (flat_position, flat_scores):
            flat_order = flat_order.gather(-1, torch.argsort(-key.gather(-1, flat_order), dim=-1, stable=True))
        flat_rank = torch.empty_like(flat_order).scatter_(
            -1, flat_order, torch.arange(flat_order.shape[-1], device=device).expand_as(flat_order)
        )
        keep = sure | (rest & (flat_rank < shared.view(-1, 1)).view(batch, kv_heads, slots))
    held = held & (~candidate | keep)
    if rule.grows:
        after = torch.where(active[..., 0], UNBOUNDED, capacity)
    elif rule.safeguard is not None:
        after = torch.where(active[..., 0], held.sum(-1), capacity)
    else:
        after = capacity
    return held, scores, after


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
        candidate = held & ~_protected(position, now, chunk.recent, chunk.sinks)
        if bool((where & ~candidate.any(-1)).any()):
            raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")
        victim = _lowest(scores, position, candidate)
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
    protected = _protected(position, now, chunk.recent, chunk.sinks)
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
        if rule.safeguard is None:
            for h in range(kv_heads):
                while int(held[b, h].sum()) > int(capacity[b, h]):
                    candidate = held[b, h] & ~protected[b, h]
                    held[b, h, _lowest(scores[b, h], position[b, h], candidate)] = False
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


def attend_chunk(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: Chunk, triton: bool = False
) -> Result:
    """Same contract as :func:`attend_chunk_reference`, fast: the prompt phase from ``prompt_votes`` (its
    Triton kernels with ``triton``, else their PyTorch references), :func:`compress`, then the decode phase
    through the row scan (``eviction_scan`` with ``triton``, else the numba scan over blocks of rows), or as plain
    masked attention when no decode row can evict and none votes."""
    n, slots = query.shape[2], key.shape[2]
    in_prompt = prompt_rows(chunk, n)
    held, scores, capacity = chunk.held, chunk.scores.float(), chunk.capacity
    output = kept = None
    if bool(in_prompt.any()):
        if slots != n:
            raise ValueError("prompt rows need an empty cache: prefill a chunk before any other")
        output, held, scores, capacity = _prompt_phase(query, key, value, chunk, in_prompt, triton)
        kept = torch.where(in_prompt.any(-1, keepdim=True), held.sum(-1), 0)
    decoding = chunk.arriving & ~in_prompt
    if not bool(decoding.any()):
        return Result(output if output is not None else torch.zeros_like(query), held, scores, capacity, kept)
    rest = replace(chunk, held=held, scores=scores, capacity=capacity, arriving=decoding)
    if rest.rule.decode_votes == DecodeVote.NONE and bool(
        (held.sum(-1) + decoding.sum(-1, keepdim=True) <= capacity).all()
    ):
        result = _attend_without_eviction(query, key, value, rest)
    elif triton and rest.rule.heads == Heads.KV:  # the Triton scan runs each KV head alone
        result = _scan_triton(query, key, value, rest)
    else:
        result = _scan_cpu(query, key, value, rest)
    if output is not None:
        result.output = torch.where(in_prompt.view(in_prompt.shape[0], 1, n, 1), output, result.output)
    result.kept = kept
    return result


def _prompt_phase(query, key, value, chunk: Chunk, in_prompt: torch.Tensor, triton: bool):
    """Prompt rows attend causally in full; their votes feed the scores; the cache is then compressed."""
    rule = chunk.rule
    last = int(chunk.prefill.clamp(max=query.shape[2]).max())
    q, k, v, rows = query[:, :, :last], key[:, :, :last], value[:, :, :last], in_prompt[:, :last]
    weights = rule.prompt_weights(rows)
    scores = chunk.scores.float().clone()
    if weights is None:
        # Without padding this is plain causal attention: SDPA's causal kernel (the same numbers, at 4k half the
        # time of the masked one).
        causal = bool(rows.all())
        cols = torch.arange(last, device=q.device)
        seen = None if causal else visible(rows, cols, cols).unsqueeze(1)
        output = (
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=seen, is_causal=causal, scale=chunk.scaling, enable_gqa=True
            )
            if chunk.output
            else None
        )
    else:
        shared = chunk.votes if not chunk.output else None
        known = [a for w, r, a in shared or () if torch.equal(w, weights) and torch.equal(r, rows)]
        if known:
            output, attention = None, known[0]
        else:
            output, attention = prompt_votes(q, k, v, rows, weights, chunk.scaling, chunk.output, triton)
        if shared is not None and not known:
            shared.append((weights, rows, attention))
        attention = share_votes(attention, rule)
        if rule.combine == Combine.REPLACE:
            scores[..., :last] = torch.where(rows.unsqueeze(1), attention, scores[..., :last])
        else:
            scores[..., :last] += attention
    full_output = torch.zeros_like(query)
    if output is not None:
        full_output[:, :, :last] = output
    held = chunk.held.clone()
    held[..., :last] |= rows.unsqueeze(1)
    now = torch.where(rows.any(-1), chunk.position[:, 0].masked_fill(~in_prompt, -1).amax(-1), -1)
    held, scores, capacity = compress(
        held, scores, chunk.position, chunk.capacity, chunk.recent, chunk.sinks, now, rule, chunk.rescore
    )
    return full_output, held, scores, capacity


def _attend_without_eviction(query, key, value, chunk: Chunk) -> Result:
    """Decode rows that can evict nothing and vote nothing: each sees the held slots and the arriving tokens
    up to itself (a padding row sees itself), blocks of rows at a time from the first arriving row, as in
    :func:`_scan_cpu` (the rows before it are the prompt's, whose output :func:`attend_chunk` keeps)."""
    n, slots = query.shape[2], key.shape[2]
    state = slots - n
    held = chunk.held.clone()
    held[..., state:] |= chunk.arriving.unsqueeze(1)
    output = torch.zeros_like(query)
    cols = torch.arange(slots, device=query.device)
    first = int(chunk.arriving.any(0).int().argmax())
    for start in range(first, n, ROW_BLOCK):
        stop = min(start + ROW_BLOCK, n)
        rows = torch.arange(start, stop, device=query.device)
        own = cols.view(1, -1) == (state + rows).view(-1, 1)
        causal = cols.view(1, -1) <= (state + rows).view(-1, 1)
        seen = (held.unsqueeze(2) & causal) | own  # [B, Hkv, rows, N]; state slots all precede the rows
        logits = grouped_logits(query[:, :, start:stop], key, chunk.scaling)
        probs = torch.softmax(logits.masked_fill(~seen.unsqueeze(2), float("-inf")), dim=-1)
        output[:, :, start:stop] = grouped_values(probs, value).to(query.dtype)
    return Result(output, held, chunk.scores, chunk.capacity)


def _scan_cpu(query, key, value, chunk: Chunk) -> Result:
    """The decode phase on the CPU: per block of rows, the block's logits, the numba scan over them, then one
    masked softmax for the block's outputs.

    A block's rows can only see the slots held when it starts and its own tokens (an evicted token never
    returns), so its logits are computed against those live slots alone (the scan reads them through
    ``column``): under a budget of C the block costs rows x (C + rows), not rows x every slot before it.

    With ``heads="layer"`` the KV heads hold one set of tokens, so the scan walks it once, as one head whose
    group is every query head of the layer (each against its own KV head's logits), and every head gets the
    result."""
    batch, n = query.shape[0], query.shape[2]
    kv_heads, slots = key.shape[1], key.shape[2]
    state = slots - n
    sets = 1 if chunk.rule.heads == Heads.LAYER else kv_heads
    layout = [chunk.held, chunk.position, chunk.scores, chunk.capacity]
    if sets == 1 and not all(torch.equal(t, t[:, :1].expand_as(t)) for t in layout):
        raise RuntimeError("heads=layer needs the KV heads of a layer to hold the same tokens with the same scores")
    held = chunk.held[:, :sets].cpu().numpy().copy()
    scores = chunk.scores[:, :sets].detach().float().cpu().numpy().copy()
    enter = np.where(held, 0, n).astype(np.int64)
    leave = np.full(held.shape, n, dtype=np.int64)
    stuck = np.zeros(held.shape[:2], dtype=np.bool_)
    arriving = chunk.arriving.cpu().numpy()
    column = np.zeros(held.shape, dtype=np.int64)
    args = (
        held,
        arriving,
        chunk.position[:, :sets].contiguous().cpu().numpy(),
        scores,
        chunk.capacity[:, :sets].contiguous().cpu().numpy(),
        chunk.recent.cpu().numpy(),
        chunk.sinks.cpu().numpy(),
        int(chunk.rule.decode_votes),
        enter,
        leave,
        stuck,
        column,
    )
    output = torch.zeros_like(query)
    first = int(np.argmax(arriving.any(0)))
    device = query.device
    buffer = torch.empty(0, dtype=torch.float32, device=device)
    for start in range(first, n, ROW_BLOCK):
        stop = min(start + ROW_BLOCK, n)
        live = torch.from_numpy(held[..., : state + stop].copy())
        live[..., state + start :] = True
        width = int(live.sum(-1).max())
        if width < state + stop:  # the live slots first, in slot order, then others (masked) up to the widest
            index = torch.argsort((~live).to(torch.int8), dim=-1, stable=True)[..., :width]
            gather = index.to(device).expand(batch, kv_heads, width).unsqueeze(-1).expand(-1, -1, -1, key.shape[-1])
            live_keys, live_values = key.gather(2, gather), value.gather(2, gather)
        else:
            index = torch.arange(width, device="cpu").expand(batch, sets, width)  # numpy indices for the scan
            live_keys, live_values = key[:, :, :width], value[:, :, :width]
        index = index.numpy()
        np.put_along_axis(column, index, np.arange(width), axis=-1)
        if buffer.numel() < query.shape[1] * batch * (stop - start) * width:
            buffer = torch.empty(query.shape[1] * batch * ROW_BLOCK * width, dtype=torch.float32, device=device)
        logits = grouped_logits(query[:, :, start:stop], live_keys, chunk.scaling, out=buffer)
        scan_rows(logits.detach().cpu().numpy().reshape(batch, sets, -1, stop - start, width), start, *args)
        if stuck.any():
            raise RuntimeError("eviction needed but every held token is protected: the plan is inconsistent")
        rows = torch.arange(start, stop, device=device).view(1, 1, -1, 1)
        enter_t = torch.from_numpy(np.take_along_axis(enter, index, -1)).to(device).unsqueeze(2)
        leave_t = torch.from_numpy(np.take_along_axis(leave, index, -1)).to(device).unsqueeze(2)
        seen = (rows >= enter_t) & (rows < leave_t)
        # A padding row sees only itself, so its (unused) output stays finite.
        own = torch.from_numpy(index).to(device).unsqueeze(2) == (state + rows)
        seen = seen | (~chunk.arriving[:, start:stop].view(batch, 1, -1, 1) & own)
        logits.masked_fill_(~seen.unsqueeze(2), float("-inf"))
        probs = logits.softmax(-1) if logits.requires_grad else torch.softmax(logits, dim=-1, out=logits)
        output[:, :, start:stop] = grouped_values(probs, live_values).to(query.dtype)
    held_t, scores_t = (torch.from_numpy(a).to(device).expand(batch, kv_heads, -1).contiguous() for a in (held, scores))
    return Result(output, held_t, scores_t, chunk.capacity)


def _scan_triton(query, key, value, chunk: Chunk) -> Result:
    from h2o_eval.kernels.eviction_scan import eviction_scan

    output, held, scores = eviction_scan(
        query,
        key,
        value,
        chunk.held,
        chunk.arriving,
        chunk.position,
        chunk.scores,
        chunk.capacity,
        chunk.recent,
        chunk.sinks,
        int(chunk.rule.decode_votes),
        chunk.scaling,
    )
    return Result(output, held, scores, chunk.capacity)


def attend_chunk_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: Chunk) -> Result:
    """:func:`attend_chunk` on the Triton kernels of ``h2o_eval.kernels``."""
    return attend_chunk(query, key, value, chunk, triton=True)


def claim_slot(
    held: torch.Tensor,
    position: torch.Tensor,
    scores: torch.Tensor,
    now: torch.Tensor,
    capacity: torch.Tensor,
    recent: torch.Tensor,
    sinks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of one arriving token per sequence, in place of a chunk: the slot [B, Hkv] it will occupy, and a
    [] bool that is True where the plan is inconsistent (a full cache whose every held token is protected).

    A full cache gives up its victim (same rule as the scan); one below capacity takes its first free slot, which
    the caller guarantees it has. Nothing here reads a value on the host: a decode step never waits for the
    device."""
    full = held.sum(-1) >= capacity
    candidate = held & ~_protected(position, now, recent, sinks)
    victim = _lowest(scores, position, candidate)
    free = (~held).to(torch.int8).argmax(-1)
    return torch.where(full, victim, free), (full & ~candidate.any(-1)).any()


def attend_slots(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """One query per sequence [B, Hq, 1, D] over the slots of keys/values [B, Hkv, S, D] that ``held`` [B, Hkv, S]
    marks (None: every slot), through torch's fused attention (SDPA), for a rule that needs no attention scores:
    each KV head's G query heads are G query rows of that head, so nothing is repeated and the mask broadcasts
    over them. Returns [B, Hq, 1, D]."""
    batch, q_heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    mask = None if held is None else held.unsqueeze(2)
    output = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
    return output.reshape(batch, q_heads, 1, dim)


def attend_held(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: torch.Tensor,
    scores: torch.Tensor,
    rule: Rule,
    scaling: float,
    triton: bool = False,
) -> torch.Tensor:
    """Steps 2-3 for one query per sequence [B, Hq, 1, D] over the held slots; updates ``scores`` in place.

    The attention and its group-summed probabilities come from ``decode_attention`` (``triton``: the Triton
    kernel of ``h2o_eval.kernels``) or its PyTorch reference.
    """
    attention = torch.zeros_like(scores)
    if triton:
        from h2o_eval.kernels.decode_attention import decode_attention

        output = decode_attention(query[:, :, 0], keys, values, held, attention, scaling)
    else:
        output = decode_attention_reference(query[:, :, 0], keys, values, held, attention, scaling)
    attention = share_votes(attention, rule)
    if rule.decode_votes == DecodeVote.ADD:
        scores += attention
    elif rule.decode_votes == DecodeVote.REPLACE:
        scores.copy_(torch.where(held, attention, scores))
    return output.unsqueeze(2)
