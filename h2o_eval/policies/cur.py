from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Plan, PromptScorer, check_flag, check_number
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.leverage import gaussian_sketch
from h2o_eval.policies.sequences import each_sequence

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")
PROJECTION = 20  # columns of the random projection (kvpress's r)


def local_shares(norms: torch.Tensor, window: int) -> torch.Tensor:
    """[H, m] each of ``norms`` [H, m] divided by the sum of its window of ``window`` consecutive tokens (windows
    from the first token; the last may be shorter)."""
    heads, length = norms.shape
    padded = torch.nn.functional.pad(norms, (0, (window - length % window) % window)).view(heads, -1, window)
    return (padded / padded.sum(dim=-1, keepdim=True)).view(heads, -1)[:, :length]


@dataclass(frozen=True)
class CUR(PromptScorer):
    """CurDKV (Sengupta et al. 2025, arXiv:2509.15038; kvpress's ``CURPress``): keep the tokens of largest approximate
    leverage, from their keys' and values' squared norms.

    A token's key leverage is its key's squared L2 norm and its value leverage its value's, each divided by the sum
    over its window of ``local_window_size`` tokens (``use_local_approximation``; windows from the prompt's first
    token), optionally after a random projection to 20 dimensions (``use_random_leverage``). The score is the key
    leverage, the value leverage, their mean or (by default) their product (``leverage_type``), divided by its sum
    over the prompt. The first ``num_sinks`` tokens are kept. Prefill and context protocols only.

    As kvpress, except for the random projection's draws (see ``leverage``: each sequence's layer l takes the
    (l + 1)-th draw of a CPU generator seeded with ``seed``); a padded batch scores each sequence's real tokens.

    Args:
        num_sinks: first tokens always kept.
        leverage_type: ``key``, ``value``, ``kv_avg`` or ``kv_product``.
        use_random_leverage: project keys and values by a Gaussian matrix first.
        use_local_approximation: normalise the squared norms within windows.
        local_window_size: the window of the local approximation.
        seed: seeds the random projection.
    """

    num_sinks: int = 4
    leverage_type: str = "kv_product"
    use_random_leverage: bool = False
    use_local_approximation: bool = True
    local_window_size: int = 16
    seed: int = 42
    name: ClassVar[str] = "cur"
    scores_held: ClassVar[bool] = True
    example: ClassVar[dict[str, Any]] = {"num_sinks": 2, "local_window_size": 4}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "num_sinks", self.num_sinks, integer=True, low=0)
        check_number(self.name, "local_window_size", self.local_window_size, integer=True, low=1)
        check_number(self.name, "seed", self.seed, integer=True, low=0)
        check_flag(self.name, "use_random_leverage", self.use_random_leverage)
        check_flag(self.name, "use_local_approximation", self.use_local_approximation)
        if self.leverage_type not in LEVERAGE_TYPES:
            raise ConfigError(
                f"{self.name}: leverage_type={self.leverage_type!r}: use one of {', '.join(LEVERAGE_TYPES)}"
            )

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=0, sinks=min(self.num_sinks, capacity))

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        return each_sequence(
            prompt, lambda row, real: self._leverage(prompt.key[row][:, real], prompt.value[row][:, real], prompt.layer)
        )

    def _leverage(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> torch.Tensor:
        """[Hkv, m] one sequence's scores from its keys and values [Hkv, m, D]."""
        if self.use_random_leverage:
            projection = gaussian_sketch(self.seed, layer, (keys.shape[-1], PROJECTION), keys.dtype).to(keys.device)
            projection = projection / math.sqrt(PROJECTION)
            keys, values = keys @ projection, values @ projection
        key_leverage, value_leverage = (keys**2).sum(dim=-1), (values**2).sum(dim=-1)
        if self.use_local_approximation:
            key_leverage = local_shares(key_leverage, self.local_window_size)
            value_leverage = local_shares(value_leverage, self.local_window_size)
        scores = {
            "key": key_leverage,
            "value": value_leverage,
            "kv_avg": (key_leverage + value_leverage) / 2,
            "kv_product": key_leverage * value_leverage,
        }[self.leverage_type]
        scores = scores / scores.sum(dim=-1, keepdim=True)
        scores[:, : self.num_sinks] = 1.0
        return scores
