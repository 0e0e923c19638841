from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Plan, Policy, Rule, check_flag, check_number
from h2o_eval.policies.inputs import Prompt, query_projection


def average_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[D, D] the mean over positions of the rotary matrices diag(cos_t) + P diag(sin_t), P the rotate-half
    permutation (kvpress's ``apply_avg_rope``); ``cos``, ``sin`` [m, D]. Each entry of those matrices is a cos, a
    +-sin or zero, so the mean is built from the means of ``cos`` and ``sin``, without making the m matrices (at
    head sizes from 32, torch's sums give the same numbers as averaging them; below, within float32 rounding)."""
    half = cos.shape[-1] // 2
    mean_cos, mean_sin = cos.mean(dim=0), sin.mean(dim=0)
    rotation = torch.diag(mean_cos)
    columns = torch.arange(half, device=cos.device)
    rotation[columns + half, columns] = mean_sin[:half]
    rotation[columns, columns + half] = -mean_sin[half:]
    return rotation


@dataclass(frozen=True)
class ExpectedAttention(Policy):
    """Expected Attention (Devoto et al. 2025, arXiv:2510.00636; kvpress's ``ExpectedAttentionPress``): keep the
    keys future queries are expected to attend to most.

    The prompt's queries before rotary embedding (all but the first ``n_sink`` tokens) are summarised by their
    mean and covariance per query head, both rotated by the mean rotary matrix of the ``n_future_positions``
    positions after the prompt; a key k's expected logit is k·mu / sqrt(D) + k^T Sigma k / (2 D), softmaxed over
    the keys (sinks excluded), averaged over the KV head's query heads, then ``(score + epsilon) * ||v||``
    (``use_vnorm``). The first ``n_sink`` tokens are always kept; nothing else is protected. Prefill and context
    protocols only (it compresses a prompt once, then keeps every later token).

    As kvpress, where it differs from the paper's reference code; beyond kvpress: batches may be left-padded (the
    statistics and the softmax run over each sequence's real tokens, its future positions start after them), and
    a model without rotary embedding (OPT) uses the statistics as they are.

    Args:
        n_future_positions: future positions whose rotary matrices are averaged.
        n_sink: first tokens always kept and left out of the statistics.
        use_covariance: add the covariance term (else the mean alone).
        use_vnorm: rescale by the value's L2 norm.
        epsilon: added to the scores before the value-norm rescaling.
    """

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    name: ClassVar[str] = "expected_attention"
    scores_held: ClassVar[bool] = True
    held_forwards: ClassVar[int] = 256  # kvpress's DecodingPress: hidden_states_buffer_size
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")
    example: ClassVar[dict[str, Any]] = {"n_sink": 2, "n_future_positions": 16}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "n_future_positions", self.n_future_positions, integer=True, low=1)
        check_number(self.name, "n_sink", self.n_sink, integer=True, low=0)
        check_number(self.name, "epsilon", self.epsilon, low=0)
        for flag in ("use_covariance", "use_vnorm"):
            check_flag(self.name, flag, getattr(self, flag))

    @property
    def rule(self) -> Rule:
        return Rule(grows=True)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=0, sinks=min(self.n_sink, capacity))

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        expected = prompt.once(
            f"expected_attention {self.n_future_positions} {self.n_sink} {self.use_covariance}",
            lambda: self._expected(prompt),
        )
        if not self.use_vnorm:
            return expected
        counted = (prompt.real & (prompt.real.cumsum(-1) > self.n_sink)).unsqueeze(1)  # real tokens past the sinks
        return torch.where(counted, (expected + self.epsilon) * prompt.value.float().norm(dim=-1), expected)

    def held_scores(self, held: Prompt, heads: torch.Tensor) -> torch.Tensor:
        """As kvpress's DecodingPress scores the cache with this policy: the statistics of the kept attention inputs
        (the last 256 forwards' since the last compression) but their first ``n_sink`` rows, rotated by the mean
        rotary matrix of the ``n_future_positions`` positions from the number of those rows (kvpress counts them
        from its buffer's length, not from the newest token's position), over the held keys but the oldest
        ``n_sink``, which score highest."""
        rows = held.hidden_states.shape[1]
        if rows <= self.n_sink:
            raise ConfigError(
                f"expected_attention as the decoding policy needs more than n_sink={self.n_sink} attention inputs "
                f"between two compressions, and has {rows}: raise interval.compression_interval or lower policy.n_sink"
            )
        keys, values = held.key[0].float(), held.value[0].float()  # [h, n, D]
        if keys.shape[1] <= self.n_sink:
            return torch.ones(1, *keys.shape[:2], device=keys.device)  # sinks only: all kept
        dim = keys.shape[-1]
        query = query_projection(held.module, held.hidden_states[:, self.n_sink :], held.query.shape[1], dim)
        group = held.query.shape[1] // held.module.config.num_key_value_heads
        query = query[0, (heads.view(-1, 1) * group + torch.arange(group, device=heads.device)).flatten()].float()
        mean = query.mean(dim=1)
        centered = query - mean.unsqueeze(1)
        covariance = torch.einsum("hni,hnj->hij", centered, centered) / query.shape[1]
        if held.rotary is not None:
            cos, sin = held.rotary(torch.arange(rows, rows + self.n_future_positions, device=keys.device))
            rotation = average_rotation(cos.float(), sin.float())
            mean, covariance = mean @ rotation.T, rotation @ covariance @ rotation.T
        key = keys[:, self.n_sink :].repeat_interleave(group, dim=0)
        logits = torch.einsum("hnd,hd->hn", key, mean) / math.sqrt(dim)
        if self.use_covariance:
            logits = logits + torch.einsum("hni,hij,hnj->hn", key, covariance, key) / dim / 2
        expected = torch.softmax(logits, dim=-1).view(len(heads), group, -1).mean(dim=1)
        if self.use_vnorm:
            expected = (expected + self.epsilon) * values[:, self.n_sink :].norm(dim=-1)
        sinks = expected.new_full((len(heads), self.n_sink), float(expected.max()) + 1)
        return torch.cat([sinks, expected], dim=-1).unsqueeze(0)

    def _expected(self, prompt: Prompt) -> torch.Tensor:
        """[B, Hkv, n] each scored prompt token's expected attention (a real token past the sinks; 0 elsewhere),
        before ``use_vnorm``'s value norms, which the policies that share this differ by."""
        queries = prompt.prerope_query().float()
        keys = prompt.key.float()
        batch, kv_heads, n, dim = keys.shape
        group = prompt.group
        found = torch.zeros(batch, kv_heads, n, dtype=torch.float32, device=keys.device)
        for row in range(batch):
            real = prompt.real[row].nonzero().flatten()
            counted = real[self.n_sink :]
            if counted.numel() == 0:
                continue
            query = queries[row][:, counted]  # [Hq, N, D]
            mean = query.mean(dim=1)
            centered = query - mean.unsqueeze(1)
            covariance = torch.einsum("hni,hnj->hij", centered, centered) / counted.numel()
            if prompt.rotary is not None:
                start = real.numel()
                positions = torch.arange(start, start + self.n_future_positions, device=keys.device)
                cos, sin = prompt.rotary(positions)
                rotation = average_rotation(cos.float(), sin.float())
                mean = mean @ rotation.T
                covariance = rotation @ covariance @ rotation.T
            key = keys[row][:, counted].repeat_interleave(group, dim=0)  # [Hq, N, D]
            logits = torch.einsum("hnd,hd->hn", key, mean) / math.sqrt(dim)
            if self.use_covariance:
                logits = logits + torch.einsum("hni,hij,hnj->hn", key, covariance, key) / dim / 2
            found[row][:, counted] = torch.softmax(logits, dim=-1).view(kv_heads, group, -1).mean(dim=1)
        return found
