from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import Plan, PromptScorer, check_flag, check_number
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.sequences import each_sequence


def lag_relative(states: torch.Tensor, lag_size: int) -> torch.Tensor:
    """[Hkv, P - 1, lag] LagKV's score of each token of the first P - 1 partitions of ``states`` [Hkv, P * lag, D]:
    the standard deviation over channels of the token min-max normalised by the next partition's per-channel range,
    softmaxed over its partition (kvpress's ``LagKVPress._get_states_score``)."""
    partitions = states.view(states.shape[0], -1, lag_size, states.shape[-1])
    reference, scored = partitions[:, 1:], partitions[:, :-1]
    low = reference.min(dim=-2, keepdim=True).values
    high = reference.max(dim=-2, keepdim=True).values
    return ((scored - low) / (high - low)).std(dim=-1).softmax(dim=-1)


@dataclass(frozen=True)
class LagKV(PromptScorer):
    """LagKV (Liang et al. 2025, arXiv:2504.04704; kvpress's ``LagKVPress``): keep the tokens that stand out from
    the partition after them.

    After the first ``n_sink`` tokens, the prompt is cut into partitions of ``lag_size`` tokens; each token of a
    partition is min-max normalised per channel by the range of the next partition, and its score is the standard
    deviation of the result over channels, softmaxed over its partition, for its key and its value (averaged). The
    scores are then replaced by their rank within the partition over ``lag_size`` (``cross_scoring=False``), so
    that every partition loses alike. The sinks and the last partition with the remainder (lag_size + (T - n_sink)
    mod lag_size tokens, which have no partition after them) are kept. A prompt shorter than n_sink + 2 lag_size
    keeps its sinks and its newest tokens (kvpress's ramp of scores). Prefill and context protocols only.

    Where it differs from kvpress: rank scores tie across partitions and ties are broken towards the newest
    partition (kvpress follows ``torch.topk``'s order); when C is smaller than the sinks and the last partition,
    which all score alike, the newest C of them are kept (kvpress: ``torch.topk``'s order); a padded batch scores
    each sequence's real tokens.

    Args:
        n_sink: first tokens always kept.
        lag_size: the partition length.
        cross_scoring: keep the softmaxed scores themselves instead of their ranks (kvpress's experimental option,
            meant for ``adakv``).
    """

    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False
    name: ClassVar[str] = "lagkv"
    scores_held: ClassVar[bool] = True
    example: ClassVar[dict[str, Any]] = {"n_sink": 2, "lag_size": 4}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "n_sink", self.n_sink, integer=True, low=0)
        check_number(self.name, "lag_size", self.lag_size, integer=True, low=1)
        check_flag(self.name, "cross_scoring", self.cross_scoring)

    def tail(self, length: int) -> int:
        """The newest tokens kept with the sinks: the last partition and the remainder."""
        return self.lag_size + (length - self.n_sink) % self.lag_size

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        capacity = self.capacity(length)
        if length < self.n_sink + 2 * self.lag_size:
            sinks = min(self.n_sink, capacity)
            return Plan(capacity=capacity, recent=capacity - sinks, sinks=sinks)
        recent = min(self.tail(length), capacity)  # all score alike: the newest stay
        return Plan(capacity=capacity, recent=recent, sinks=min(self.n_sink, capacity - recent))

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        return each_sequence(
            prompt, lambda row, real: self._scores(prompt.key[row][:, real], prompt.value[row][:, real])
        )

    def _scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """[Hkv, T] one prompt's scores from its keys and values [Hkv, T, D]: 1 on the sinks and the tail (too short
        to partition: 1 on the sinks, the others the newer the higher)."""
        found = keys.new_ones(keys.shape[:-1], dtype=torch.float32)
        length = keys.shape[1]
        if length < self.n_sink + 2 * self.lag_size:  # the sinks, then the newer the higher (kvpress's ramp)
            ramp = torch.arange(max(length - self.n_sink, 0), device=keys.device) / max(length - self.n_sink, 1)
            found[:, self.n_sink :] = ramp.to(keys.dtype)
            return found
        partitioned = slice(self.n_sink, length - (length - self.n_sink) % self.lag_size)
        lagged = (
            lag_relative(keys[:, partitioned], self.lag_size) + lag_relative(values[:, partitioned], self.lag_size)
        ) / 2
        if not self.cross_scoring:
            lagged = lagged.argsort(dim=-1).argsort(dim=-1) / self.lag_size
        found[:, self.n_sink : partitioned.stop - self.lag_size] = lagged.flatten(1).to(keys.dtype)
        return found
