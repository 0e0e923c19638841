from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import Votes, check_number
from h2o_eval.policies.inputs import Prompt, output_projection
from h2o_eval.policies.wrapper import Wrapper


def projected_value_norm(value: torch.Tensor, projection: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv, n] the L1 norm of each value [B, Hkv, n, D] projected through the layer's output projection
    (``projection``, W_O per query head [Hq, D, hidden]), ||v W_O^h||_1 per query head h, averaged over the KV
    head's ``group`` query heads (kvpress's ``CriticalKVPress.vwl1norm``)."""
    projection, value = projection.float(), value.float()
    batch, _, n, _ = value.shape
    heads = projection.shape[0]
    norms = value.new_empty(batch, heads, n)
    for head in range(heads):  # one head at a time, as kvpress, to bound the memory; its KV head's values as they are
        norms[:, head] = (value[:, head // group] @ projection[head]).abs().sum(dim=-1)
    return norms.view(batch, heads // group, group, n).mean(dim=2)


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
    added at that scale). Prefill and context protocols only; the decoding policy of ``decoding=interval`` over a
    base that can be (kvpress's DecodingPress over CriticalKVPress: :meth:`rescore_held`).

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
    interval_ready: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "epsilon", self.epsilon, low=0)
        check_number(self.name, "first_stage_ratio", self.first_stage_ratio, low=0, high=1)

    @property
    def rescores(self) -> bool:
        return True

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        base = self.base.compression_scores(prompt, scores, protected)
        base = (self.averaged(scores, prompt.group) if base is None else base).float()
        norms = prompt.once(
            "projected_value_norm", lambda: projected_value_norm(prompt.value, prompt.output_projection(), prompt.group)
        )
        real = prompt.real.unsqueeze(1).expand_as(base)
        return self.two_stages(base, norms, real, protected, prompt.capacity)

    def rescore_held(
        self,
        scores: torch.Tensor,
        protected: torch.Tensor,
        values: torch.Tensor,
        held: torch.Tensor,
        capacity: torch.Tensor,
        module: torch.nn.Module | None,
    ) -> torch.Tensor:
        """As kvpress's DecodingPress compresses the cache with this policy: the two stages over the base's scores
        of what is held, C being the target."""
        heads, dim = module.config.num_attention_heads, values.shape[-1]
        group = heads // values.shape[1]
        norms = projected_value_norm(values, output_projection(module, heads, dim), group)
        base = scores if self.base.scores_held else self.averaged(scores, group)
        return self.two_stages(base.float(), norms, held, protected, capacity)

    def averaged(self, votes: torch.Tensor, group: int) -> torch.Tensor:
        """The base's scores from its pooled ``votes``: a window's averaged over its rows and the KV head's
        ``group`` query heads, as kvpress's SnapKV means them; others as they are."""
        if self.base.rule.votes == Votes.WINDOW:
            return votes / (self.base.rule.window * group)
        return votes

    def two_stages(
        self,
        base: torch.Tensor,
        norms: torch.Tensor,
        candidate: torch.Tensor,
        protected: torch.Tensor,
        capacity: torch.Tensor,
    ) -> torch.Tensor:
        """The scores [B, Hkv, n] of the ``candidate`` tokens: the top int(C * first_stage_ratio) of each KV head by
        the ``base`` scores (``protected`` first; ties: the earlier slot) the highest, the rest
        (base + epsilon) * ``norms``."""
        first = (capacity.float() * self.first_stage_ratio).floor().long()
        if self.first_stage_ratio > 0:
            first = first.clamp(min=1)
        ranked = base.masked_fill(protected, float("inf")).masked_fill(~candidate, float("-inf"))
        order = ranked.argsort(dim=-1, descending=True, stable=True)
        chosen = torch.zeros_like(candidate).scatter(-1, order, torch.arange(order.shape[-1], device=order.device)
                                                     .expand_as(order) < first.unsqueeze(-1))  # fmt: skip
        reweighted = (base + self.epsilon) * norms
        return reweighted.masked_fill(chosen & candidate, torch.finfo(torch.float32).max)
