"""What every policy is: a budget, a cache layout (:class:`Plan`) and a score :class:`Rule` over one mechanism.

Every policy answers, for a sequence of ``length`` tokens, its :class:`Plan` (capacity C per KV head, the current
token included; how many most recent tokens and how many first tokens are protected) and its :class:`Rule` (how
the unprotected tokens compete for the remaining slots). When a token arrives and the cache holds C tokens, the
unprotected token with the lowest score is evicted for good; ties go to the oldest token. The mechanism
(``h2o_eval.eviction``) and every implementation of it read only these two descriptions, plus
:meth:`Policy.key_scores` for scores that need no attention.

``budget`` is a fraction in (0, 1] of the length, C = max(1, ceil(budget * length)), or an integer number of
tokens, C = budget whatever the length (a sequence shorter than C never evicts). C is at least 1: the current
token is always held.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from h2o_eval.errors import ConfigError

PROTOCOLS = ("simulate", "prefill", "context")
# Implementations of the mechanism: auto (Triton kernels on CUDA, the numba-compiled scan elsewhere), torch (the
# plain reference loop), triton (the Triton kernels, forced).
KERNELS = ("auto", "torch", "triton")
UNBOUNDED = 2**62  # a capacity no sequence reaches: nothing is ever evicted


@dataclass(frozen=True)
class Plan:
    """The realised cache layout of one sequence in one layer: ``capacity`` slots, ``recent`` + ``sinks``
    protected."""

    capacity: int
    recent: int
    sinks: int = 0


@dataclass(frozen=True)
class Rule:
    """How scores are made and used: the data every implementation of the mechanism reads.

    Args:
        votes: which query rows' attention (summed over the KV head's query heads, see ``heads``) feeds the
            scores: ``"all"`` rows, the last ``window`` rows of a prompt (``"window"``), or ``"none"`` (scores
            come from :meth:`Policy.key_scores`, or recency alone decides).
        combine: ``"add"``: votes accumulate (H2O); ``"replace"``: the latest vote is the score (TOVA).
        window: the voting rows of ``votes="window"``.
        pooling: ``None``, ``"max"`` or ``"avg"``: when a prompt is compressed, the scores of the tokens older
            than the protected recent window are pooled along positions like torch's ``max_pool1d`` /
            ``avg_pool1d`` (stride 1, padding ``kernel_size // 2``).
        kernel_size: the pooling window (odd).
        grows: after the prompt is compressed every later token is kept (the SnapKV family, as their papers
            run them); otherwise each arriving token evicts one once the cache holds C.
        safeguard: ``None``: each KV head keeps its own C. A share in [0, 1]: when a prompt is compressed, the
            layer's Hkv * C slots go to the best scores of all its KV heads together, each head guaranteed its
            protected tokens and its floor(safeguard * C) best (Ada-KV); heads then hold different numbers.
        heads: ``"kv"``: each KV head's votes are its own query heads' attention, so each head keeps its own
            tokens. ``"layer"``: every KV head gets the votes of all the layer's query heads summed, so the heads
            of a layer, starting alike (an empty cache, one capacity), keep one set of tokens (TOVA as its
            authors run it).
    """

    votes: str = "none"
    combine: str = "add"
    window: int = 0
    pooling: str | None = None
    kernel_size: int = 1
    grows: bool = False
    safeguard: float | None = None
    heads: str = "kv"

    def __post_init__(self) -> None:
        if self.heads not in ("kv", "layer"):
            raise ConfigError(f"Rule: heads={self.heads!r}: use one of kv, layer")

    @property
    def decode_votes(self) -> int:
        """What an arriving token past the prompt does to the scores: 0 adds its attention, 1 replaces them
        with it, 2 nothing (window votes belong to the prompt)."""
        if self.votes != "all":
            return 2
        return 0 if self.combine == "add" else 1

    def prompt_weights(self, prompt_rows: torch.Tensor) -> torch.Tensor | None:
        """[B, n] float: how much each prompt row's attention counts in the scores at compression (``prompt_rows``
        [B, n] bool marks the real rows of each sequence's prompt); None when no row votes."""
        if self.votes == "none":
            return None
        from_end = prompt_rows.flip(-1).cumsum(-1).flip(-1)  # 1 on a prompt's last real row, 2 before it, ...
        voters = self.window if self.votes == "window" else prompt_rows.shape[-1]
        if self.combine == "replace":
            voters = 1
        return (prompt_rows & (from_end <= voters)).float()


def check_number(owner: str, name: str, value: Any, *, integer: bool = False, low=None, high=None) -> None:
    """Refuse a parameter of the wrong type or out of [low, high], in one line naming the valid range."""
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if integer:
        ok = ok and isinstance(value, int)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        if low is not None and high is not None:
            bounds = f" in [{low}, {high}]"
        else:
            bounds = f" >= {low}" if low is not None else f" <= {high}" if high is not None else ""
        raise ConfigError(f"{owner}: {name}={value!r}: use {kind}{bounds}")


@dataclass(frozen=True)
class Policy:
    """Base class: a budget and the rule that fills the unprotected slots.

    Args:
        budget: fraction of the sequence in (0, 1], or an integer number of tokens >= 1.
    """

    budget: float | int = 0.2
    name: ClassVar[str]
    # The protocols the policy exists in (see README): simulate, prefill, context.
    protocols: ClassVar[tuple[str, ...]] = PROTOCOLS

    def __post_init__(self) -> None:
        budget = self.budget
        is_int = isinstance(budget, int) and not isinstance(budget, bool)
        if not (is_int and budget >= 1) and not (isinstance(budget, float) and 0 < budget <= 1):
            raise ConfigError(
                f"budget={budget!r}: use a fraction in (0, 1] such as 0.2, or a token count >= 1 (1 is one token; "
                "1.0 the whole cache)"
            )

    @property
    def rule(self) -> Rule:
        return Rule()

    def capacity(self, length: int) -> int:
        """C for a sequence of ``length`` tokens (fractions round up, and C is never below 1)."""
        if isinstance(self.budget, float):
            return max(1, math.ceil(self.budget * length - 1e-9))
        return self.budget

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        """The layout of ``layer`` (of ``num_layers``) for a sequence of ``length`` tokens."""
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=capacity)

    def key_scores(self, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor | None:
        """Scores that need no attention, computed once per token as it arrives: key [B, Hkv, n, D] and its
        positions [B, Hkv, n] -> [B, Hkv, n] float32; None: scores start at 0."""
        return None

    def attention(self, query, key, value, valid, scaling) -> torch.Tensor | None:
        """A policy that is no eviction cache at all (the authors' H2O simulation) computes the attention
        itself: output [B, Hq, T, D]. None: the mechanism does."""
        return None

    @property
    def has_cache(self) -> bool:
        """Whether the policy runs as a cache (and so can generate): not if it computes its own attention."""
        return type(self).attention is Policy.attention

    @property
    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_protocol(policy: Policy, protocol: str, kernels: str) -> None:
    """Refuse a protocol or kernel choice that does not exist, or that this policy cannot run."""
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={protocol!r}: use one of {', '.join(PROTOCOLS)}")
    if protocol not in policy.protocols:
        raise ConfigError(
            f"policy {policy.name!r} exists only in the {' and '.join(policy.protocols)} protocol"
            f"{'s' if len(policy.protocols) > 1 else ''}: use protocol={policy.protocols[0]}"
        )
    if kernels not in KERNELS:
        raise ConfigError(f"kernels={kernels!r}: use one of {', '.join(KERNELS)}")


def check_kernels(kernels: str, device_type: str) -> None:
    """Refuse ``kernels=triton`` where Triton cannot run: it needs CUDA, or its interpreter for tests."""
    if kernels == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"kernels=triton needs a CUDA device, not {device_type}: use kernels=auto (TRITON_INTERPRET=1 runs "
            "the kernels in Triton's interpreter, for tests)"
        )
