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
        held, position = rehearsal.held, rehearsal.position
        batch, kv_heads, slots = held.shape
        prefix, _ = template_parts(rehearsal.script.tokenizer)
        scores = scores.clone()
        for row in range(batch):
            if not bool(rehearsal.real[row].any()):
                continue
            start, end = self.spans(len(rehearsal.script.context[row]), prefix)[rehearsal.index]
            sink = min(self.n_sink, start)
            tokens = position[row]
            chunk = held[row] & (tokens >= start) & (tokens < end)
            own = rehearsal.real[row].view(1, -1).expand(kv_heads, -1)
            columns = torch.cat([(held[row] & (tokens < sink)) | chunk, own], dim=-1)  # [Hkv, S + m]
            attention = _attention(rehearsal, row, columns, self.kvzip_plus_normalization)  # [Hkv, G, m, S + m]
            best = attention[..., :slots].amax(dim=(1, 2))  # max over the group and the pass's queries
            scores[row] = torch.where(chunk, best, scores[row])
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
            counts = torch.tensor([int((~value.isnan()).sum()) for value in ranked])
            layer_of = torch.repeat_interleave(torch.arange(len(ranked)), counts)
            lowest = flat.argsort(stable=True)[:gone]
            dropped = torch.bincount(layer_of[lowest], minlength=len(ranked))
            for layer in range(len(ranked)):
                allocated[layer][row, 0] = int(counts[layer] - dropped[layer])
        return allocated


def _attention(rehearsal: Rehearsal, row: int, columns: torch.Tensor, plus: bool) -> torch.Tensor:
    """[Hkv, G, m, S + m] one sequence's pass attention with the softmax over ``columns`` [Hkv, S + m]; with
    ``plus`` (KVzip+), each query's row divided by its input's norm and each column weighed by ||v W_O||."""
    single = Rehearsal(
        index=rehearsal.index,
        script=rehearsal.script,
        module=rehearsal.module,
        layer=rehearsal.layer,
        query=rehearsal.query[row : row + 1],
        key=rehearsal.key[row : row + 1],
        value=rehearsal.value[row : row + 1],
        held=rehearsal.held[row : row + 1],
        position=rehearsal.position[row : row + 1],
        real=rehearsal.real[row : row + 1],
        scaling=rehearsal.scaling,
    )
    attention = single.probabilities(columns.unsqueeze(0))[0]
    if not plus:
        return attention
    kv_heads, group, m, _ = attention.shape
    projection = output_projection(rehearsal.module, kv_heads * group, rehearsal.query.shape[-1]).float()
    projection = projection.view(kv_heads, group, *projection.shape[1:])  # [Hkv, G, D, hidden]
    written = torch.einsum("hgdj,htd->hgtj", projection, rehearsal.value[row].float()).norm(dim=-1)
    inputs = rehearsal.hidden_states[row].float().norm(dim=-1)  # [m]
    return attention / inputs.view(1, 1, m, 1) * written.unsqueeze(2)
