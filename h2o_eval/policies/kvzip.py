from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import Plan, Policy, Rule, check_flag, check_number
from h2o_eval.policies.inputs import Rehearsal, Script, output_projection

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk a later repeat starts from (kvpress's prev_postfix_size)


@functools.lru_cache(maxsize=8)
def template_parts(tokenizer: Any) -> tuple[int, tuple[int, ...]]:
    """(prefix length, suffix ids) of the tokenizer's chat template around a user turn, as kvpress's ``KVzipPress``
    reads them: the tokens before the user's text (never repeated) and those after it (end of turn, assistant
    header) that open each repeat; without a template: (0, the ids of a newline)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return 0, tuple(tokenizer.encode("\n", add_special_tokens=False))
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False,
        enable_thinking=False,
    )  # fmt: skip
    context, suffix = rendered.split(separator)
    prefix = context.split(dummy)[0]
    return len(tokenizer.encode(prefix, add_special_tokens=False)), tuple(
        tokenizer.encode(suffix, add_special_tokens=False)
    )


def pruned(total: int, budget: float | int, units: int) -> int:
    """How many of ``total`` pairs go: kvpress's int(total * (1 - budget)) for a fraction budget; for an integer
    budget (tokens per KV head and layer), all but budget of each of the ``units`` (layer, KV head) pairs' share."""
    if isinstance(budget, float):
        return int(total * (1 - budget))
    return max(0, total - budget * units)


@dataclass(frozen=True)
class KVzip(Policy):
    """KVzip (Kim et al. 2025, arXiv:2505.23416; kvpress's ``KVzipPress``): keep the KV pairs the model needs to
    repeat its context.

    After the context, the model is asked to repeat it: per chunk of ``chunk_size`` context tokens (after the chat
    template's prefix), an extra pass feeds "Repeat the previous context exactly." (later chunks: "Repeat the part
    of the previous context exactly, starting with" and the previous chunk's last 8 tokens), the template's end of
    turn and the chunk itself. A context token's score is the largest attention any of that pass's queries (of
    its KV head's group) gives it, the softmax running over the first ``n_sink`` tokens, the chunk and the pass
    itself; the passes' keys and values are then dropped. The first ``n_sink`` tokens are always kept; the
    template's other prefix tokens get no score and go first. Selection is model-wide (``layerwise=False``,
    kvpress's default: the lowest int(N * (1 - budget)) of all N layers' and heads' pairs go, so layers keep
    different shares) or per layer (``layerwise=True``: the lowest int(Hkv * L * (1 - budget)) of each layer's
    pairs go); either way a layer's KV heads share its slots. Prefill and context protocols only.

    As kvpress, except: a batch may hold several (left-padded) sequences, each selected alone; an integer budget
    keeps budget pairs per KV head and layer on the average; Gemma 3 (which kvpress refuses) runs, its sliding
    layers keeping their window and taking no part in the selection.

    Args:
        layerwise: one share per layer (True) or a model-wide selection (False).
        n_sink: first tokens always kept.
        chunk_size: context tokens repeated per pass.
        kvzip_plus_normalization: KVzip+: each query's attention divided by the norm of its input, each key's by
            ||v W_O|| multiplied.
    """

    layerwise: bool = False
    n_sink: int = 4
    chunk_size: int = 2048
    kvzip_plus_normalization: bool = False
    name: ClassVar[str] = "kvzip"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")
    example: ClassVar[dict[str, Any]] = {"n_sink": 2, "chunk_size": 16}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flag(self.name, "layerwise", self.layerwise)
        check_flag(self.name, "kvzip_plus_normalization", self.kvzip_plus_normalization)
        check_number(self.name, "n_sink", self.n_sink, integer=True, low=0)
        check_number(self.name, "chunk_size", self.chunk_size, integer=True, low=1)

    @property
    def rule(self) -> Rule:
        return Rule(grows=True, safeguard=0.0)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=0, sinks=min(self.n_sink, capacity))

    def spans(self, length: int, prefix: int) -> list[tuple[int, int]]:
        """(start, end) token indices of the chunks of a ``length``-token context that are repeated."""
        return [(start, min(start + self.chunk_size, length)) for start in range(prefix, length, self.chunk_size)]

    def passes(self, script: Script) -> list[list[list[int]]]:
        prefix, suffix = template_parts(script.tokenizer)
        first = script.tokenizer.encode(FIRST, add_special_tokens=False)
        later = script.tokenizer.encode(LATER, add_special_tokens=False)
        spans = [self.spans(len(context), prefix) for context in script.context]
        passes = []
        for index in range(max((len(s) for s in spans), default=0)):
            rows = []
            for context, chunks in zip(script.context, spans, strict=True):
                if index >= len(chunks):
                    rows.append([])
                    continue
                start, end = chunks[index]
                ask = first if index == 0 else later + context[max(start - OVERLAP, chunks[index - 1][0]) : start]
                rows.append(ask + list(suffix) + context[start:end])
            passes.append(rows)
        return passes

    def rehearse(self, rehearsal: Rehearsal, scores: torch.Tensor) -> torch.Tensor:
        """Each sequence's chunk scored (:func:`_best`). Where the pass's attention splits
        (:meth:`~h2o_eval.policies.inputs.Rehearsal.splits`), the attention that scores is the one the layer outputs
        (``rehearsal.output``): its softmax's normaliser over the scored slots comes with it."""
        held, position = rehearsal.held, rehearsal.position
        batch = held.shape[0]
        prefix, _ = template_parts(rehearsal.script.tokenizer)
        split = rehearsal.splits()
        scores, outputs = scores.clone(), []
        for row in range(batch):
            tokens, passed = position[row], bool(rehearsal.real[row].any())
            visible = torch.zeros_like(held[row])
            if passed:
                start, end = self.spans(len(rehearsal.script.context[row]), prefix)[rehearsal.index]
                chunk = held[row] & (tokens >= start) & (tokens < end)
                visible = (held[row] & (tokens < min(self.n_sink, start))) | chunk
            normaliser = None
            if split:
                output, normaliser = rehearsal.split_attention(row, visible[0].nonzero().flatten())
                outputs.append(output)
            if passed:
                best = _best(rehearsal, row, visible, self.kvzip_plus_normalization, normaliser)
                scores[row] = torch.where(chunk, best, scores[row])
        if split:
            rehearsal.output = torch.stack(outputs)
        return scores

    def allocate(
        self, scores: list[torch.Tensor], held: list[torch.Tensor], capacities: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Every layer's share of the kept pairs (put in its first KV head; its heads share the layer's slots):
        of a layer's real pairs (``layerwise``) or of all layers' real pairs, those with the lowest scores go, as
        many as :func:`pruned` says; the first ``n_sink`` tokens never go."""
        batch, kv_heads, _ = scores[0].shape
        allocated = [torch.zeros_like(c) for c in capacities]
        for row in range(batch):
            length = int(held[0][row, 0].sum())
            ranked = []
            for layer_scores, layer_held in zip(scores, held, strict=True):
                real = layer_held[row]
                tokens = real.cumsum(-1) - 1
                value = layer_scores[row].float().masked_fill(real & (tokens < self.n_sink), float("inf"))
                ranked.append(value.masked_fill(~real, float("nan")))
            if self.layerwise:
                for layer in range(len(ranked)):
                    allocated[layer][row, 0] = kv_heads * length - pruned(kv_heads * length, self.budget, kv_heads)
                continue
            flat = torch.cat([value[~value.isnan()] for value in ranked])
            gone = pruned(flat.numel(), self.budget, kv_heads * len(ranked))
            counts = torch.stack([(~value.isnan()).sum() for value in ranked])
            layer_of = torch.repeat_interleave(torch.arange(len(ranked), device=counts.device), counts)
            lowest = flat.argsort(stable=True)[:gone]
            dropped = torch.bincount(layer_of[lowest], minlength=len(ranked))
            for layer in range(len(ranked)):
                allocated[layer][row, 0] = int(counts[layer] - dropped[layer])
        return allocated


BLOCK = 256  # the pass's queries scored at a time: the probabilities of one block are held at once


def _best(
    rehearsal: Rehearsal, row: int, visible: torch.Tensor, plus: bool, normaliser: torch.Tensor | None = None
) -> torch.Tensor:
    """[Hkv, S] one sequence's largest pass attention (over the KV head's group and the pass's real queries) on
    each of the slots ``visible`` [Hkv, S], the softmax running over those slots and the pass's tokens up to each
    query (as :meth:`~h2o_eval.policies.inputs.Rehearsal.probabilities` restricted to those columns); zero on the
    other slots. ``normaliser`` [Hq, m]: that softmax's log-sum-exp per query where known
    (:meth:`~h2o_eval.policies.inputs.Rehearsal.split_attention`), else it is computed here. With ``plus``
    (KVzip+), each query's attention is divided by its input's norm and each slot's multiplied by ||v W_O||. Only
    the visible slots' keys are read, a block of queries at a time."""
    kv_heads, slots = visible.shape
    group = rehearsal.query.shape[1] // kv_heads
    m = int(rehearsal.real[row].sum())  # a pass's real tokens come first, its padding after
    columns = visible.any(0).nonzero().flatten()
    allowed = visible[:, columns].view(kv_heads, 1, 1, -1)
    everywhere = bool(allowed.all())
    key = rehearsal.key[row].float()
    slot_keys, own_keys = key[:, columns], key[:, slots : slots + m]  # [Hkv, n, D], [Hkv, m, D]
    query = rehearsal.query[row, :, :m].float().view(kv_heads, group, m, -1)
    if normaliser is not None:
        normaliser = normaliser[:, :m].view(kv_heads, group, m, 1)
    if plus:
        dim = query.shape[-1]
        projection = output_projection(rehearsal.module, kv_heads * group, dim).float()
        projection = projection.view(kv_heads, group, dim, -1)  # [Hkv, G, D, hidden]
        value = rehearsal.value[row, :, columns].float()
        written = torch.einsum("hgdj,htd->hgtj", projection, value).norm(dim=-1)  # [Hkv, G, n]
        inputs = rehearsal.hidden_states[row, :m].float().norm(dim=-1)  # [m]
    best = query.new_zeros(kv_heads, columns.numel())
    for first in range(0, m, BLOCK):
        last = min(first + BLOCK, m)
        block = query[:, :, first:last]
        logits = torch.matmul(block, slot_keys.unsqueeze(1).transpose(-1, -2)).mul_(rehearsal.scaling)
        if not everywhere:
            logits.masked_fill_(~allowed, float("-inf"))
        if normaliser is None:
            own = torch.matmul(block, own_keys[:, :last].unsqueeze(1).transpose(-1, -2)).mul_(rehearsal.scaling)
            rows = torch.arange(first, last, device=query.device)
            own.masked_fill_(rows.view(-1, 1) < torch.arange(last, device=query.device).view(1, -1), float("-inf"))
            total = torch.logaddexp(logits.logsumexp(-1, keepdim=True), own.logsumexp(-1, keepdim=True))
        else:
            total = normaliser[:, :, first:last]
        attention = logits.sub_(total).exp_()  # [Hkv, G, b, n]
        if plus:
            attention = attention / inputs[first:last].view(1, 1, -1, 1) * written.unsqueeze(2)
        best = torch.maximum(best, attention.amax(dim=(1, 2)))
    scored = best.new_zeros(kv_heads, slots)
    scored[:, columns] = best.masked_fill(~allowed.view(kv_heads, -1), 0.0)
    return scored
