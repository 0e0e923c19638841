from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.policies.base import Plan, Policy, Rule
from h2o_eval.policies.inputs import Prompt, query_projection


@dataclass(frozen=True)
class ObservedAttention(Policy):
    """Observed attention (kvpress's ``ObservedAttentionPress``, after H2O, Zhang et al. 2023, arXiv:2306.14048):
    keep the prompt tokens with the largest average attention.

    A token's score is the attention the prompt's queries gave it (their full causal softmax), summed over the rows
    and divided by the number of rows that could see it (the prompt's length minus its index), averaged over the
    KV head's query heads. Nothing is protected; the prompt is compressed once and every later token is kept
    (prefill and context protocols only). As the decoding policy of ``decoding=interval`` (kvpress's
    ``DecodingPress``), it scores what the cache holds by the compressing forward's attention (:meth:`held_scores`).

    How it differs from ``h2o``: H2O sums the attention a token received (so the first tokens, seen by every row,
    gain the most), keeps a recent window of C - floor(C * heavy_ratio) tokens, and evicts one token per arriving
    token after the prompt; this policy averages over the rows that saw each token, protects nothing and never
    evicts after the prompt.

    As kvpress, which reads the eager attention weights; beyond kvpress, a padded batch counts each sequence's real
    rows.
    """

    name: ClassVar[str] = "observed_attention"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")
    scores_held: ClassVar[bool] = True
    held_forwards: ClassVar[int] = 1  # the compressing forward's rows: kvpress reads that forward's eager weights

    @property
    def rule(self) -> Rule:
        return Rule(votes="all", grows=True)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=0)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        rows = prompt.real.flip(-1).cumsum(-1).flip(-1)  # [B, n] the real prompt rows at or after each column
        return scores / rows.clamp(min=1).unsqueeze(1) / prompt.group

    def held_scores(self, held: Prompt, heads: torch.Tensor) -> torch.Tensor:
        """As kvpress's DecodingPress scores the cache with this policy, from the eager attention weights of the
        forward that compresses it: that forward's rows (each at its own position, seeing the held tokens up to
        itself) summed per held token, divided by n, n - 1, ..., 1 along the held tokens (kvpress divides by the
        prompt's row counts along its cache, whatever rows voted), averaged over the KV head's query heads. kvpress
        divides along its cache's order, which its ``topk`` leaves by score after a compression; here the held
        tokens are in position order (``kvpress_compare``'s ``ordered`` ties)."""
        keys, hidden = held.key[0].float(), held.hidden_states  # [h, n, D], [1, m, hidden]
        count, dim, rows = keys.shape[1], keys.shape[-1], hidden.shape[1]
        heads_all = held.query.shape[1]
        group = heads_all // held.module.config.num_key_value_heads
        query = query_projection(held.module, hidden, heads_all, dim)[0].float()  # [Hq, m, D]
        query = query[(heads.view(-1, 1) * group + torch.arange(group, device=heads.device)).flatten()]
        if held.rotary is not None:  # the newest held tokens are the forward's own: the last at the newest position
            from transformers.models.llama.modeling_llama import rotate_half  # not at import: a CLI check needs none

            cos, sin = held.rotary(held.position[0, -1] - rows + 1 + torch.arange(rows, device=keys.device))
            query = query * cos.float() + rotate_half(query) * sin.float()
        logits = query @ keys.repeat_interleave(group, dim=0).transpose(-1, -2) * held.scaling  # [h G, m, n]
        last_seen = count - rows + torch.arange(rows, device=keys.device).view(-1, 1)  # row r sees up to its token
        logits = logits.masked_fill(torch.arange(count, device=keys.device) > last_seen, float("-inf"))
        votes = torch.softmax(logits, dim=-1).sum(dim=1) / torch.arange(count, 0, -1, device=keys.device)
        return votes.view(1, len(heads), group, count).mean(dim=2)
