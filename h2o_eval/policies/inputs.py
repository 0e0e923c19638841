"""What a policy's scorer sees: one layer's prompt when it is compressed (:class:`Prompt`), and, for a policy that
scores by extra passes before the compression (KVzip's repeat pass, the oracle's teacher-forced answer), what the
passes are built from (:class:`Script`) and what each pass's queries show one layer (:class:`Rehearsal`).

Shapes: B sequences, Hq query heads over Hkv KV heads (G = Hq / Hkv per group), n columns of the compressed chunk
(left padding included; ``real`` marks the tokens), D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from h2o_eval.errors import ConfigError


def query_projection(module: torch.nn.Module, hidden_states: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """The attention module's query states before rotary embedding [B, Hq, n, D] (kvpress's
    ``get_prerope_query_states``: ``q_proj``, or Phi-3's fused ``qkv_proj``, then the query norm of Qwen3/Gemma 3)."""
    batch, length, _ = hidden_states.shape
    if hasattr(module, "qkv_proj"):
        query = module.qkv_proj(hidden_states)[..., : heads * dim]
    elif hasattr(module, "q_proj"):
        query = module.q_proj(hidden_states)
    else:
        raise ConfigError(
            f"{type(module).__name__} has no q_proj: this policy needs the queries before rotary embedding; use a "
            "Llama-style model (Llama, Mistral, Qwen, Phi-3, Gemma 3, OPT)"
        )
    query = query.view(batch, length, heads, dim).transpose(1, 2)
    return module.q_norm(query) if hasattr(module, "q_norm") else query


def output_projection(module: torch.nn.Module, heads: int, dim: int) -> torch.Tensor:
    """The attention module's output projection per query head, W_O as [Hq, D, hidden]."""
    linear = getattr(module, "o_proj", None) or getattr(module, "out_proj", None)
    if not isinstance(linear, torch.nn.Linear):
        raise ConfigError(
            f"{type(module).__name__} has no o_proj: this policy reads the output projection; use a Llama-style model"
        )
    return linear.weight.t().reshape(heads, dim, -1)


@dataclass
class Prompt:
    """One layer's prompt as a policy's scorer sees it when the prompt is compressed.

    Attributes:
        module: the layer's attention module (its projections: :meth:`prerope_query`, :meth:`output_projection`).
        layer: the layer's index.
        query: [B, Hq, n, D] the prompt's queries after rotary embedding, as the attention used them.
        key, value: [B, Hkv, n, D] the keys (after rotary embedding) and values, as the cache holds them.
        position: [B, n] each column's token index in its sequence.
        real: [B, n] bool, the prompt's real tokens (False: padding).
        capacity: [B, Hkv] C of this layer.
        hidden_states: [B, n, hidden] the attention module's input, or None where the forward did not pass it.
        rotary: ``rotary(positions)`` for positions [m] gives (cos, sin) [m, D] of this layer's rotary embedding;
            None for a model without one.
        scaling: the attention's logit scale.
        shared: what the scorers of the other caches fed this prompt in one :class:`~h2o_eval.groups.SharedPrompt`
            layer pass computed (:meth:`once`); None outside such a pass.
    """

    module: torch.nn.Module
    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    position: torch.Tensor
    real: torch.Tensor
    capacity: torch.Tensor
    hidden_states: torch.Tensor | None
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
    scaling: float
    shared: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.key.shape[1]

    def prerope_query(self) -> torch.Tensor:
        """[B, Hq, n, D] the queries before rotary embedding, recomputed from the attention's input; for a model
        without rotary embedding, the queries as they are."""
        if self.rotary is None:
            return self.query
        if self.hidden_states is None:
            raise ConfigError("this policy needs the attention's input, which this model's forward does not pass")
        heads, dim = self.query.shape[1], self.query.shape[-1]
        return query_projection(self.module, self.hidden_states, heads, dim).to(self.query.dtype)

    def output_projection(self) -> torch.Tensor:
        """W_O per query head [Hq, D, hidden]."""
        return output_projection(self.module, self.query.shape[1], self.query.shape[-1])

    def once(self, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()``, a function of this prompt alone (not of the capacity), computed once per
        :class:`~h2o_eval.groups.SharedPrompt` layer pass for the caches whose prompts have the same real tokens (a
        policy at several budgets scores the prompt once). ``key`` names the computation and everything it depends on
        besides the prompt; each caller gets its own copy."""
        if self.shared is None:
            return compute()
        known = self.shared.get(key)
        if known is None or not torch.equal(known[0], self.real):
            known = self.shared[key] = (self.real, compute())
        return known[1].clone()


@dataclass
class Script:
    """What a policy's extra passes are built from, per sequence (no padding): ``context``, the tokens being
    compressed; ``question``, the tokens that follow them (under ``protocol=context``; empty under ``prefill``,
    where the question is part of the compressed prompt); ``answer``, the full cache's greedy answer (only for a
    policy that asks for it); and the tokenizer (a pass may be worded in the model's chat template)."""

    context: list[list[int]]
    question: list[list[int]]
    answer: list[list[int]] | None
    tokenizer: Any


@dataclass
class Rehearsal:
    """What one extra pass shows a layer: its tokens' queries against the compressed chunk's slots and the pass's
    own tokens, before the pass is dropped again.

    Attributes:
        index: which pass (of the policy's :meth:`~h2o_eval.policies.Policy.passes`).
        script: what the passes were built from.
        module, layer, scaling: as in :class:`Prompt`.
        query: [B, Hq, m, D] the pass's queries after rotary embedding.
        key, value: [B, Hkv, S + m, D] the S slots the cache holds, then the pass's own m tokens.
        held: [B, Hkv, S] bool, the held slots (the compressed chunk's real tokens).
        position: [B, Hkv, S] each slot's token index.
        real: [B, m] bool, the pass's real tokens (a shorter pass is padded at its end).
        hidden_states: [B, m, hidden] the attention module's input for the pass, or None.
    """

    index: int
    script: Script
    module: torch.nn.Module
    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    held: torch.Tensor
    position: torch.Tensor
    real: torch.Tensor
    scaling: float
    hidden_states: torch.Tensor | None = None
    output: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.held.shape[-1]

    def splits(self) -> bool:
        """Whether :meth:`split_attention` can give the pass's attention: on a CPU (its fused kernel returns the
        log-sum-exp), with every KV head holding the same tokens (a prompt before its compression)."""
        same = (self.held == self.held[:, :1]).all() & (self.position == self.position[:, :1]).all()
        return self.query.device.type == "cpu" and bool(same)

    def split_attention(self, row: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's pass attention as the model computes it, each query over the held slots and the pass's
        tokens up to itself: [Hq, m, D]; and per query the log-sum-exp of its logits over the held slots
        ``columns`` (indices) and its own tokens up to itself [Hq, m], the normaliser of the softmax restricted to
        those (:meth:`probabilities` with columns). Three fused attentions (the slots ``columns``, the other held
        slots, the pass causally) are combined by their log-sum-exps, so that nothing is computed twice. Needs
        :meth:`splits`."""
        kv_heads, (heads, m, dim) = self.key.shape[1], self.query.shape[1:]
        group, slots = heads // kv_heads, self.slots
        query, key, value = self.query[row], self.key[row], self.value[row]
        chosen = torch.zeros(slots, dtype=torch.bool, device=key.device)
        chosen[columns] = True
        rest = (self.held[row, 0] & ~chosen).nonzero().flatten()
        grouped = query.reshape(kv_heads, group * m, dim)  # a KV head's G query heads as G * m query rows
        parts = [
            tuple(t.reshape(heads, m, *t.shape[2:]) for t in _fused(grouped, key[:, i], value[:, i], self.scaling))
            for i in (columns, rest)
            if i.numel()
        ]
        own = _fused(
            query, *(t[:, slots:].repeat_interleave(group, 0) for t in (key, value)), self.scaling, causal=True
        )
        normaliser = torch.logaddexp(parts[0][1], own[1]) if columns.numel() else own[1]
        parts.append(own)
        total = torch.logsumexp(torch.stack([lse for _, lse in parts]), 0)
        output = sum(out * torch.exp(lse - total).unsqueeze(-1) for out, lse in parts)
        return output.to(query.dtype), normaliser

    def probabilities(self, columns: torch.Tensor | None = None) -> torch.Tensor:
        """[B, Hkv, G, m, S + m] the pass's attention probabilities (float32): each real row over the held slots
        and the pass's real tokens up to itself, restricted to ``columns`` [B, Hkv, S + m] when given (the softmax
        then runs over those alone); zero on pad rows."""
        batch, kv_heads, total = self.key.shape[0], self.key.shape[1], self.key.shape[2]
        m, slots = self.query.shape[2], self.slots
        group = self.query.shape[1] // kv_heads
        query = self.query.view(batch, kv_heads, group, m, -1).float()
        logits = torch.matmul(query, self.key.float().unsqueeze(2).transpose(-1, -2)) * self.scaling
        rows = torch.arange(m, device=logits.device)
        visible = torch.zeros(batch, kv_heads, m, total, dtype=torch.bool, device=logits.device)
        visible[..., :slots] = self.held.unsqueeze(-2)
        visible[..., slots:] = (rows.view(-1, 1) >= rows.view(1, -1)) & self.real.view(batch, 1, 1, m)
        if columns is not None:
            visible &= columns.unsqueeze(-2)
        visible[..., rows, slots + rows] = True  # every row sees itself, so no softmax is empty
        probs = torch.softmax(logits.masked_fill(~visible.unsqueeze(2), float("-inf")), dim=-1)
        return probs * self.real.view(batch, 1, 1, m, 1)


def _fused(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [H, L, D], log-sum-exp of each query's logits [H, L]) of torch's fused CPU attention (the kernel SDPA
    runs), ``query`` [H, L, D] over ``key`` and ``value`` [H, n, D]; ``causal``: query i sees keys up to i."""
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), is_causal=causal, scale=scaling
    )
    return output[0], lse[0]
