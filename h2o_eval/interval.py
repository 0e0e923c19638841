"""``decoding=interval`` (kvpress's DecodingPress): what a layer counts between two compressions, and the scores it
is compressed by.

A layer under ``decoding=interval`` grows after its prompt's compression (every arriving token is held) and counts,
on the host, the forwards fed since its last compression (:class:`Steps`); before the forward after the
``steps``-th (or after a chunk of at least the target's tokens) it is compressed to the target, as a prompt is
(:func:`h2o_eval.compression.compress`), by the decoding policy's scores over everything it holds
(:func:`interval_scores`): its key scores, plus the attention votes of the queries fed since the last compression,
rebuilt from the attention's input as kvpress's DecodingPress rebuilds them from its buffered hidden states (query
projection, then the last forward's rotary embedding: each row at its own position if that forward fed them all,
else every one at the newest token's position), each voting row over the held tokens up to its own position; or,
for a policy that scores what is held (``scores_held``: keydiff, cur, lagkv, expected_attention), its scores of
what each KV head holds, in position order, as kvpress hands its ScorerPress the cache it holds (with the attention
inputs kept since the last compression, as kvpress's buffer of hidden states: :func:`held_scores`).
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import rotate_half

from h2o_eval.compression import compress
from h2o_eval.decode import Slots
from h2o_eval.errors import ConfigError
from h2o_eval.policies import UNBOUNDED, Interval, Policy, Rule
from h2o_eval.policies.base import Combine, Heads, Votes
from h2o_eval.policies.inputs import Prompt, query_projection


class Steps:
    """One layer's host counts between two compressions under ``decoding=interval`` (a layer has none under another
    decoding; ``interval`` None counts nothing): the forwards fed (``steps``) and the last one's tokens per sequence
    (``chunk``); for a decoding policy whose votes read the newest ``keep`` rows (0: none), or whose scores of what is
    held read the attention inputs of the last ``forwards`` forwards (kvpress's buffer of hidden states), that attention
    input (``rows``, [B, m, hidden] each), attention module and logit scale."""

    def __init__(self, interval: Interval | None) -> None:
        self.interval = interval
        self.keep = 0 if interval is None else voters(interval.policy.rule, UNBOUNDED)
        self.forwards = 0 if interval is None else interval.policy.held_forwards
        self.steps = 0
        self.chunk = 0
        self.rows: list[torch.Tensor] = []
        self.module: torch.nn.Module | None = None
        self.scaling = 1.0

    def fed(self, chunk: int) -> None:
        """A forward of ``chunk`` tokens per sequence after the prompt."""
        if self.interval is not None:
            self.steps += 1
            self.chunk = chunk

    def record(self, layer, module: torch.nn.Module, hidden_states: torch.Tensor | None, scaling: float, n: int):
        """A layer's recorder (:attr:`~h2o_eval.layer.EvictionLayer.recorders`), before it attends a forward of ``n``
        tokens per sequence: :meth:`saw` (``decoding=interval`` counts the forwards where they are taken: a chunk's
        in the layer, a decode step's in :class:`Intervals`)."""
        self.saw(layer, module, hidden_states, scaling)

    def saw(self, layer, module: torch.nn.Module, hidden_states: torch.Tensor | None, scaling: float) -> None:
        """Before ``layer`` attends a forward after its prompt: note its attention module and logit scale, and keep
        its attention input [B, n, hidden] where the decoding policy's votes read it."""
        if self.interval is None or not layer.seen or layer.window is not None:
            return
        self.module, self.scaling = module, scaling
        if not self.keeps:
            return
        if hidden_states is None:
            raise ConfigError("decoding=interval: this decoding policy votes, and the model does not pass the "
                              "attention's input: use a key-scored decoding policy such as knorm")  # fmt: skip
        self.rows.append(hidden_states.detach())
        if self.forwards:
            del self.rows[: -self.forwards]
        while self.keep and sum(rows.shape[1] for rows in self.rows[1:]) >= self.keep:
            self.rows.pop(0)

    @property
    def keeps(self) -> bool:
        """Whether the steps keep their attention input (and so run eagerly, not as CUDA graphs)."""
        return bool(self.keep or self.forwards)

    def due(self, seen: int) -> bool:
        """Whether the layer is compressed before its next forward, ``seen`` tokens having been fed."""
        interval = self.interval
        return self.steps >= interval.compression_interval or (self.steps > 0 and self.chunk >= interval.target(seen))

    def reset(self) -> None:
        self.steps, self.chunk, self.rows = 0, 0, []

    def rows_of(self, rows: list[int]) -> Steps:
        """A copy for the sequences ``rows``."""
        copy = Steps(self.interval)
        copy.steps, copy.chunk, copy.module, copy.scaling = self.steps, self.chunk, self.module, self.scaling
        copy.rows = [hidden[rows] for hidden in self.rows]
        return copy


class Turn(Steps):
    """``protocol=turns``: what a layer records of a turn's forwards, decode steps included, for the compression at
    the turn's end (:func:`turn_compression`)."""

    def record(self, layer, module: torch.nn.Module, hidden_states: torch.Tensor | None, scaling: float, n: int):
        self.saw(layer, module, hidden_states, scaling)
        self.fed(n)


class Intervals:
    """``decoding=interval``'s decode layout (:class:`~h2o_eval.layouts.DecodeLayout`): the layout ``inner`` its layer
    settled in, wrapped. Its steps count as forwards fed (``steps``); before a step its counts say is due, the layer
    is compressed (``compress``: it compresses and settles anew, its new layout prepared, and says whether it did),
    and the step goes by the layout the layer then has."""

    def __init__(self, inner, steps: Steps, compress) -> None:
        self.inner, self.steps, self.compress = inner, steps, compress

    slots = property(lambda self: self.inner.slots)
    most = property(lambda self: self.inner.most)

    def prepare(self) -> None:
        if not self.compress():
            self.inner.prepare()

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self.inner.step(query, key, value)

    def advance(self) -> None:
        self.inner.advance()
        self.steps.fed(1)

    def tensors(self) -> list[torch.Tensor | None]:
        return self.inner.tensors()

    def compacted(self) -> Slots:
        return self.inner.compacted()

    def faults(self) -> list[str]:
        return self.inner.faults()


def voters(rule: Rule, fed: int) -> int:
    """How many of the newest ``fed`` rows vote under ``rule``: the window's, every one, the latest, or none."""
    if rule.votes == Votes.NONE:
        return 0
    if rule.combine == Combine.REPLACE:
        return 1
    return fed if rule.votes == Votes.ALL else rule.window


def held_scores(policy: Policy, layer: int, slots: Slots, capacity: int, steps: Steps, rotary) -> torch.Tensor:
    """[B, Hkv, S] the scores ``policy`` (``scores_held``: :meth:`~h2o_eval.policies.Policy.held_scores`) gives what
    each KV head of a layer holds (``slots``), its tokens laid out in position order as kvpress's cache holds them,
    with the attention inputs ``steps`` kept; the KV heads of a sequence that hold as many tokens are scored
    together. The slots held by none score 0 (they are not kept)."""
    keys, values, held, position = slots.keys, slots.values, slots.held, slots.position
    batch, kv_heads, _, dim = keys.shape
    hidden = torch.cat(steps.rows, dim=1) if steps.rows else None
    heads_all = kv_heads if steps.module is None else steps.module.config.num_attention_heads
    order = torch.where(held, position, torch.iinfo(position.dtype).max).argsort(dim=-1, stable=True)
    counts = held.sum(-1).tolist()  # a compression reads the device (as a chunk does)
    found = torch.zeros(held.shape, dtype=torch.float32, device=keys.device)
    for row in range(batch):
        for count in sorted(set(counts[row]) - {0}):
            heads = torch.tensor([h for h in range(kv_heads) if counts[row][h] == count], device=keys.device)
            slot = order[row, heads, :count]  # [h, count]
            gather = slot.unsqueeze(-1).expand(-1, -1, dim)
            ordered = Prompt(
                module=steps.module,
                layer=layer,
                query=keys.new_zeros(1, heads_all, 0, dim),
                key=keys[row, heads].gather(1, gather).unsqueeze(0),
                value=values[row, heads].gather(1, gather).unsqueeze(0),
                position=position[row, heads[0]].gather(0, slot[0]).unsqueeze(0),
                real=torch.ones(1, count, dtype=torch.bool, device=keys.device),
                capacity=torch.full((1, len(heads)), capacity, dtype=torch.int64, device=keys.device),
                hidden_states=None if hidden is None else hidden[row : row + 1],
                rotary=None if rotary is None else (lambda at: rotary(layer, at)),
                scaling=steps.scaling,
            )
            scores = policy.held_scores(ordered, heads)
            found[row, heads] = found[row, heads].scatter(1, slot, scores[0].float())
    return found


def interval_scores(
    policy: Policy,
    layer: int,
    keys: torch.Tensor,
    held: torch.Tensor,
    position: torch.Tensor,
    now: torch.Tensor,
    steps: Steps,
    rotary,
    scaling: float,
) -> torch.Tensor:
    """[B, Hkv, S] the decoding policy's scores of the slots (keys [B, Hkv, S, D], ``held``, ``position``) of a layer
    whose newest token is at ``now`` [B]: its key scores, and the attention its voting rows give the held tokens
    (summed over the rows and the KV head's query heads; their queries rotated as the module says, each row seeing
    the held tokens up to its own position). A ``scores_held`` policy is scored by :func:`held_scores` instead."""
    rule = policy.rule
    found = policy.key_scores(keys, position, layer)
    scores = torch.zeros(held.shape, dtype=torch.float32, device=keys.device) if found is None else found.float()
    if not steps.rows:
        return scores
    hidden = torch.cat(steps.rows, dim=1)
    count = min(voters(rule, hidden.shape[1]), hidden.shape[1])
    if rotary is None:
        raise ConfigError("decoding=interval: a voting decoding policy rebuilds queries with the rotary embedding, "
                          "which this model has not: use a key-scored decoding policy such as knorm")  # fmt: skip
    batch, kv_heads, slots, dim = keys.shape
    heads = steps.module.config.num_attention_heads
    query = query_projection(steps.module, hidden[:, hidden.shape[1] - count :], heads, dim).to(keys.dtype)
    # kvpress rotates the rows with the last forward's rotary embedding: each at its own position when that forward
    # fed them all, else every one at the newest token's position.
    offset = torch.arange(1 - count, 1, device=keys.device) if steps.chunk >= count else now.new_zeros(1)
    at = (now.view(-1, 1) + offset.view(1, -1)).expand(batch, -1)
    cos, sin = rotary(layer, at.reshape(-1))  # [B * rows, D]
    cos, sin = cos.view(batch, 1, -1, dim), sin.view(batch, 1, -1, dim)
    query = (query * cos + rotate_half(query) * sin).view(batch, kv_heads, heads // kv_heads, count, dim)
    logits = torch.matmul(query.float(), keys.float().unsqueeze(2).transpose(-1, -2)) * scaling
    row = now.view(-1, 1, 1) - count + 1 + torch.arange(count, device=keys.device).view(1, -1, 1)  # [B, count, 1]
    visible = held.unsqueeze(-2) & (position.unsqueeze(-2) <= row.unsqueeze(1))  # [B, Hkv, count, S]
    probs = torch.softmax(logits.masked_fill(~visible.unsqueeze(2), float("-inf")), dim=-1)
    votes = probs.sum((2, 3))
    return votes if rule.combine == Combine.REPLACE else scores + votes


def layer_heads(policy: Policy, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` [B, Hkv, S] as ``policy``'s rule keeps them: under ``heads=layer`` (TOVA) the KV heads of a layer,
    which hold the same tokens in the same slots, all take the layer's sum, so that they keep the same tokens."""
    return scores.sum(1, keepdim=True).expand_as(scores) if policy.rule.heads == Heads.LAYER else scores


def between(layer) -> bool:
    """Whether ``layer`` (an :class:`~h2o_eval.layer.EvictionLayer`) is compressed before its next forward under
    ``decoding=interval``, its host counts say (:meth:`~h2o_eval.layer.EvictionLayer.compress_held` then reads the
    device, as a chunk does); never for a sliding layer's own window or during an extra pass."""
    steps = layer.steps
    if steps.interval is None or layer.window is not None or layer.shared.rehearsing is not None:
        return False
    return steps.due(layer.seen)


def compression(steps: Steps, context, layer: int, seen: int, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
    """``decoding=interval``'s compression of layer ``layer`` (``seen`` tokens fed, holding ``slots``) to the target by
    its decoding policy's scores over everything it holds (``context``: the layer's
    :class:`~h2o_eval.context.LayerContext`): the slots then held and their scores."""
    interval = steps.interval
    plan = interval.layout(interval.policy, seen, layer, context.num_layers)
    capacity = torch.full(slots.held.shape[:2], plan.capacity, dtype=torch.int64, device=slots.held.device)
    return _compressed(interval.policy, steps, context, layer, slots, slots.held, capacity, plan)


def turn_compression(
    steps: Steps, context, layer: int, slots: Slots, since: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``protocol=turns``' compression of layer ``layer`` (holding ``slots``; ``context``: its
    :class:`~h2o_eval.context.LayerContext`) after a turn, by its policy's scores as an interval compression makes
    them (:func:`interval_scores`, :func:`held_scores`: key scores and the votes of the attention inputs ``steps``
    recorded since the last compression, or its scores of what is held) and with the layout an interval compression
    keeps (:meth:`~h2o_eval.policies.Interval.layout`: the policy's recent window and sinks at the target). The
    candidates are every held token (``since`` None: FlowKV's nested schedule) or those at positions from ``since``
    [B] on (its new-turn-only schedule); each KV head keeps the policy's capacity of its candidates' count
    (``policy.capacity``: the budget's fraction, rounded as the run says) and every token that is no candidate, with
    its score. Returns the slots then held and their scores."""
    policy, held = context.policy, slots.held
    candidate = held if since is None else held & (slots.position >= since.view(-1, 1, 1))
    counts = candidate.sum(-1)
    capacity = counts.cpu().apply_(policy.capacity).to(counts.device).minimum(counts)  # reads the device, as a chunk
    target = max(1, int(capacity.max()))
    plan = Interval(target_size=target, policy=policy).layout(policy, target, layer, context.num_layers)
    kept, found = _compressed(policy, steps, context, layer, slots, candidate, capacity, plan)
    return (held & ~candidate) | kept, torch.where(candidate, found, slots.scores)


def _compressed(policy: Policy, steps: Steps, context, layer: int, slots: Slots, candidate, capacity, plan):
    """The ``candidate`` slots [B, Hkv, S] of ``slots`` compressed to ``capacity`` [B, Hkv] as a prompt is
    (:func:`h2o_eval.compression.compress`), by ``policy``'s scores over everything held (its scores of what is held,
    or :func:`interval_scores`; a layer's under ``heads=layer``), ``plan``'s recent window and sinks protected:
    the candidates kept, and their scores."""
    held, position = slots.held, slots.position
    now = torch.where(held, position, -1).amax((1, 2))  # the newest token held is the newest fed
    recent = torch.full(now.shape, plan.recent, dtype=torch.int64, device=now.device)
    sinks = torch.full(now.shape, plan.sinks, dtype=torch.int64, device=now.device)
    if policy.scores_held:
        scores = held_scores(policy, layer, slots, max(1, int(capacity.max())), steps, context.rotary)
    else:
        scores = interval_scores(policy, layer, slots.keys, held, position, now, steps, context.rotary, steps.scaling)
    scores = layer_heads(policy, scores)

    def rescore(pooled: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        return policy.rescore_held(pooled, protected, slots.values, candidate, capacity, steps.module)

    kept, scores, _ = compress(candidate, scores, position, capacity, recent, sinks, now, policy.rule, rescore)
    return kept, scores
