from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import UNBOUNDED, DecodeVote, Plan, Policy, Rule, check_flag, check_number
from h2o_eval.policies.wrapper import Wrapper


@dataclass(frozen=True)
class DMS(Wrapper):
    """A score threshold instead of a budget (kvpress's ``DMSPress``, after Dynamic Memory Sparsification, Łańcucki
    et al. 2025, arXiv:2506.05345, without its trained evictors): any scoring ``base`` scores the tokens, the newest
    ``sliding_window`` are protected, and every older token scoring below ``threshold`` is evicted.

    When the prompt is compressed, each token older than the window whose score (the base's, as the base compresses
    by them) is below the threshold goes; heads keep different numbers of tokens, so the budget plays no part: the
    base is built at budget 1.0 whatever the budget given (a scorer press in kvpress's DMSPress keeps its ratio of
    0), a run's record says budget 1.0, and its realised capacities say what was kept. With ``decoding`` the cache
    keeps doing it while decoding: each arriving token is scored by the base's per-token scores (``key_scores``),
    and at the end of every forward each token that has left the window by then and scores below the threshold
    goes, its slot freed. Without it, every token after the prompt is kept (kvpress's default).

    As kvpress's press: the prompt attends in full and is compressed after it; a forward's tokens (a question fed
    at once) all see what the cache held before it, and what leaves the window during it is dropped at its end.
    kvpress masks the evicted keys in a cache that keeps them; here they are gone, and the bytes follow what each
    head holds (a ragged layout, :mod:`h2o_eval.decode`).

    Args:
        base: the scoring policy (``make_policy("dms", base="knorm", threshold=-5)``); any policy whose scores rank
            tokens per KV head, but one that shares its layer's slots or chooses capacities across layers by budget
            (``adakv``, ``kvzip``).
        threshold: the score below which a token goes (the base's scale: minus a key norm for ``knorm``).
        sliding_window: the newest tokens protected (kvpress's ``sliding_window_size``).
        decoding: whether tokens are also dropped while decoding; needs a base that scores each token as it arrives
            and whose scores no later query changes (``knorm``, ``random``).
    """

    threshold: float | None = None
    sliding_window: int = 128
    decoding: bool = False
    name: ClassVar[str] = "dms"
    default_base_name: ClassVar[str] = "knorm"
    base_budget: ClassVar[float] = 1.0
    # A threshold below any key-norm score: the generic suites run the policy through every path, evicting nothing
    # (no threshold reproduces a budget); tests/test_threshold.py proves what it drops.
    example: ClassVar[dict[str, Any]] = {"threshold": -1e9}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threshold is None:
            raise ConfigError(f"{self.name}: threshold=None: give the score below which tokens go (threshold=T)")
        check_number(self.name, "threshold", self.threshold)
        check_number(self.name, "sliding_window", self.sliding_window, integer=True, low=0)
        check_flag(self.name, "decoding", self.decoding)
        if self.decoding and not per_token(self.base):
            raise ConfigError(
                f"{self.name}: decoding=true scores each arriving token alone, and base={self.base.name!r} scores a "
                "prompt as a whole or by attention: use a base with per-token key scores such as knorm (or "
                "decoding=false)"
            )

    @classmethod
    def refusal(cls, base: Policy) -> str | None:
        if (reason := super().refusal(base)) is not None:
            return reason
        if base.rule.safeguard is not None or type(base).allocate is not Policy.allocate:
            return "hands out its slots by budget, which a threshold replaces: use its base"
        return None

    @property
    def rule(self) -> Rule:
        return dataclasses.replace(
            self.base.rule, grows=True, safeguard=None, threshold=float(self.threshold), drops=self.decoding
        )

    def capacity(self, length: int) -> int:
        return UNBOUNDED - 1  # no budget: the threshold decides what stays

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=self.sliding_window)


def per_token(policy: Policy) -> bool:
    """Whether ``policy`` scores each token as it arrives (key or position scores) and nothing later changes them:
    what dropping tokens while decoding needs."""
    return (
        (type(policy).key_scores is not Policy.key_scores or policy.positional)
        and not policy.rescores
        and not policy.rehearses
        and policy.rule.decode_votes == DecodeVote.NONE
    )
