from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from h2o_eval.policies.base import Rule, check_number
from h2o_eval.policies.wrapper import Wrapper


@dataclass(frozen=True)
class AdaKV(Wrapper):
    """Ada-KV (Feng et al. 2024, arXiv:2407.11550): a scoring policy whose KV heads share their layer's slots.

    When the prompt is compressed, each layer's Hkv * C slots go to the best scores of all its KV heads
    together; each head is guaranteed its protected tokens and its floor(alpha * C) best (the safeguard), as
    kvpress's AdaKVPress does. Heads then hold different numbers of tokens. Everything else (scores, layout,
    what happens after the prompt) is the ``base`` policy's, which may be any policy whose scores rank tokens
    per KV head (:meth:`Wrapper.refusal`). Prefill and context protocols only. As the decoding policy of
    ``decoding=interval``, every interval compression shares the layer's Hkv * target slots the same way over what
    the heads hold; kvpress's DecodingPress over AdaKVPress masks its keys instead (docs/policies.md).

    Args:
        base: the scoring policy (a :class:`Policy`; ``make_policy("adakv", base="snapkv", window=16)`` builds
            it from its name and parameters).
        alpha: the safeguard share of C guaranteed to each head.
    """

    alpha: float = 0.2
    name: ClassVar[str] = "adakv"
    default_base_name: ClassVar[str] = "snapkv"
    example: ClassVar[dict[str, Any]] = {"window": 4}
    interval_ready: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "alpha", self.alpha, low=0, high=1)

    @property
    def rule(self) -> Rule:
        return dataclasses.replace(self.base.rule, safeguard=self.alpha)
