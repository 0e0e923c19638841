from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import Votes, check_number
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.wrapper import Wrapper


def projected_value_norm(prompt: Prompt) -> torch.Tensor:
    """[B, Hkv, n] the L1 norm of each value projected through the layer's output projection, ||v W_O^h||_1 per
    query head h, averaged over the KV head's query heads (kvpress's ``CriticalKVPress.vwl1norm``)."""
    projection = prompt.output_projection().float()  # [Hq, D, hidden]
    values = prompt.value.float().repeat_interleave(prompt.group, dim=1)  # [B, Hq, n, D]
    norms = (
        torch.stack([values[:, head] @ projection[head] for head in range(projection.shape[0])], dim=1)
        .abs()
        .sum(dim=-1)
    )  # [B, Hq, n]; one head at a time, as kvpress, to bound the memory
    batch, heads, n = norms.shape
    return norms.view(batch, heads // prompt.group, prompt.group, n).mean(dim=2)


@dataclass(frozen=True)
class CriticalKV(Wrapper):
    """CriticalKV (Feng et al. 2025, arXiv:2502.03805; kvpress's ``CriticalKVPress``): a base policy's scores
    reweighted by how much each value changes the layer's output, in two stages.

    Stage 1 keeps the top int(C * first_stage_ratio) tokens of each KV head by the base's own scores (protected
    tokens first, as kvpress's maximal scores for sinks and windows put them first); stage 2 ranks the rest by
    (score + epsilon) * ||v W_O||_1 (:func:`projected_value_norm`). The base is any policy whose scores rank tokens
    per KV head (default: ``expected_attention`` with ``use_vnorm=false``, kvpress's ``critical_expected_attention``).
    Where it differs from kvpress: stage 1's count is taken of this policy's C (kvpress: int(L * (1 - ratio) *
    first_stage_ratio), the same with ``rounding=down``); a base voting with a window of prompt rows (SnapKV)
    has its summed votes divided by the window and the group (kvpress's SnapKV averages them, and epsilon is
    added at that scale). Prefill and context protocols only.

    Args:
        base: the scoring policy.
        epsilon: added to the base's scores before the reweighting.
        first_stage_ratio: the share of C chosen by the base's scores alone.
    """

    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    name: ClassVar[str] = "criticalkv"
    default_base_name: ClassVar[str] = "expected_attention"
    default_base_params: ClassVar[dict[str, Any]] = {"use_vnorm": False}
    example: ClassVar[dict[str, Any]] = {"n_sink": 2, "n_future_positions": 16}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "epsilon", self.epsilon, low=0)
        check_number(self.name, "first_stage_ratio", self.first_stage_ratio, low=0, high=1)

    @property
    def rescores(self) -> bool:
        return True

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        base = self.base.compression_scores(prompt, scores, protected)
        if base is None and self.base.rule.votes == Votes.WINDOW:  # kvpress's SnapKV means its votes
            base = scores / (self.base.rule.window * prompt.group)
        base = (scores if base is None else base).float()
        real = prompt.real.unsqueeze(1).expand_as(base)
        first = (prompt.capacity.float() * self.first_stage_ratio).floor().long()
        if self.first_stage_ratio > 0:
            first = first.clamp(min=1)
        ranked = base.masked_fill(protected, float("inf")).masked_fill(~real, float("-inf"))
        order = ranked.argsort(dim=-1, descending=True, stable=True)
        chosen = torch.zeros_like(real).scatter(-1, order, torch.arange(order.shape[-1], device=order.device)
                                                .expand_as(order) < first.unsqueeze(-1))  # fmt: skip
        reweighted = (base + self.epsilon) * prompt.once("projected_value_norm", lambda: projected_value_norm(prompt))
        return reweighted.masked_fill(chosen & real, torch.finfo(torch.float32).max)
