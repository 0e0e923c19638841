"""Eviction policies: small declarative settings over one mechanism (see ``eviction.py``).

Every policy answers two questions for a sequence of ``length`` tokens: its :class:`Plan` (capacity C per KV
head, the current token included; how many most recent tokens and how many first tokens are protected) and its
score rule (how the unprotected tokens compete for the remaining slots). When a token arrives and the cache
holds C tokens, the unprotected token with the lowest score is evicted for good; ties go to the oldest token.

``budget`` is a fraction in (0, 1] of the length, C = max(1, ceil(budget * length)), or an integer number of
tokens, C = budget whatever the length (a sequence shorter than C never evicts). C is at least 1: the current
token is always held.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from enum import Enum
from typing import ClassVar

from h2o_eval.errors import ConfigError

PROTOCOLS = ("simulate", "prefill")
# Implementations of the mechanism: auto (Triton kernels on CUDA, the numba-compiled scan elsewhere), torch (the
# plain reference loop), triton (the Triton kernels, forced).
KERNELS = ("auto", "torch", "triton")


class ScoreRule(str, Enum):
    ACCUMULATE = "accumulate"  # sum of the attention each token received so far (H2O)
    CURRENT = "current"  # the attention of the latest query only (TOVA)
    RANDOM = "random"  # a seeded random number per (layer, KV head, position)
    NONE = "none"  # no unprotected slots: recency decides


@dataclass(frozen=True)
class Plan:
    """The realised cache layout for one sequence: ``capacity`` slots, ``recent`` + ``sinks`` protected."""

    capacity: int
    recent: int
    sinks: int = 0


@dataclass(frozen=True)
class Policy:
    """Base class: a budget and the rule that fills the unprotected slots.

    Args:
        budget: fraction of the sequence in (0, 1], or an integer number of tokens >= 1.
    """

    budget: float | int = 0.2
    name: ClassVar[str]
    rule: ClassVar[ScoreRule] = ScoreRule.ACCUMULATE
    simulate_only: ClassVar[bool] = False

    def __post_init__(self) -> None:
        budget = self.budget
        is_int = isinstance(budget, int) and not isinstance(budget, bool)
        if not (is_int and budget >= 1) and not (isinstance(budget, float) and 0 < budget <= 1):
            raise ConfigError(f"budget={budget!r}: use a fraction in (0, 1] such as 0.2, or a token count >= 1")

    def capacity(self, length: int) -> int:
        """C for a sequence of ``length`` tokens (fractions round up, and C is never below 1)."""
        if isinstance(self.budget, float):
            return max(1, math.ceil(self.budget * length - 1e-9))
        return self.budget

    def plan(self, length: int) -> Plan:
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=capacity)

    @property
    def params(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Full(Policy):
    """No eviction: the cache holds the whole sequence, whatever the budget."""

    budget: float | int = 1.0
    name: ClassVar[str] = "full"
    rule: ClassVar[ScoreRule] = ScoreRule.NONE

    def capacity(self, length: int) -> int:
        return max(1, length)


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy-Hitter Oracle (arXiv:2306.14048): accumulated attention plus the most recent tokens.

    Args:
        heavy_ratio: share of the capacity for heavy hitters, floor(C * heavy_ratio); the rest, at least
            the current token, is the recent window.
    """

    heavy_ratio: float = 0.5
    name: ClassVar[str] = "h2o"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.heavy_ratio <= 1:
            raise ConfigError(f"heavy_ratio={self.heavy_ratio!r}: use a value in [0, 1]")

    def plan(self, length: int) -> Plan:
        capacity = self.capacity(length)
        heavy = math.floor(capacity * self.heavy_ratio + 1e-9)
        return Plan(capacity=capacity, recent=max(1, capacity - heavy))


@dataclass(frozen=True)
class Local(Policy):
    """Only the most recent tokens (a sliding window of C)."""

    name: ClassVar[str] = "local"
    rule: ClassVar[ScoreRule] = ScoreRule.NONE


@dataclass(frozen=True)
class Heavy(Policy):
    """Heavy hitters only, plus the current token."""

    name: ClassVar[str] = "heavy"

    def plan(self, length: int) -> Plan:
        return Plan(capacity=self.capacity(length), recent=1)


@dataclass(frozen=True)
class Streaming(Policy):
    """StreamingLLM (arXiv:2309.17453): the first ``sinks`` tokens plus the most recent ones.

    Args:
        sinks: attention-sink tokens kept from the start (at most C - 1).
    """

    sinks: int = 4
    name: ClassVar[str] = "streaming"
    rule: ClassVar[ScoreRule] = ScoreRule.NONE

    def plan(self, length: int) -> Plan:
        capacity = self.capacity(length)
        sinks = min(self.sinks, capacity - 1)
        return Plan(capacity=capacity, recent=capacity - sinks, sinks=sinks)


@dataclass(frozen=True)
class TOVA(Policy):
    """TOVA (arXiv:2401.06104): evict the token the latest query attended to least."""

    name: ClassVar[str] = "tova"
    rule: ClassVar[ScoreRule] = ScoreRule.CURRENT

    def plan(self, length: int) -> Plan:
        return Plan(capacity=self.capacity(length), recent=1)


@dataclass(frozen=True)
class Random(H2O):
    """H2O's layout with a seeded random score in place of accumulated attention (a control)."""

    seed: int = 0
    name: ClassVar[str] = "random"
    rule: ClassVar[ScoreRule] = ScoreRule.RANDOM


@dataclass(frozen=True)
class H2OReference(H2O):
    """The H2O authors' lm-eval simulation, reproduced exactly (simulate protocol only; see eviction.py)."""

    name: ClassVar[str] = "h2o_reference"
    simulate_only: ClassVar[bool] = True

    def budgets(self, length: int) -> tuple[int, int]:
        """(hb, rb) as the authors compute them: int(budget * heavy_ratio * T), int(budget * (1 - heavy_ratio) * T);
        an integer budget counts tokens instead of budget * T."""
        tokens = length * self.budget if isinstance(self.budget, float) else self.budget
        return int(tokens * self.heavy_ratio), int(tokens * (1 - self.heavy_ratio))


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, H2O, Local, Heavy, Streaming, TOVA, Random, H2OReference)
}


def make_policy(name: str, budget: float | int = 0.2, **params: float | int) -> Policy:
    """The policy ``name`` with ``budget`` and its own parameters (``heavy_ratio``, ``sinks``, ``seed``)."""
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    allowed = {f.name for f in fields(cls)} - {"budget"}
    if unknown := set(params) - allowed:
        raise ConfigError(
            f"policy {name!r} takes no {', '.join(sorted(unknown))}: its parameters are "
            f"{', '.join(sorted(allowed)) or 'budget only'}"
        )
    if cls is Full:
        return Full()
    return cls(budget=budget, **params)


def check_protocol(policy: Policy, protocol: str, kernels: str) -> None:
    """Refuse a protocol or kernel choice that does not exist, or that this policy cannot run."""
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={protocol!r}: use one of {', '.join(PROTOCOLS)}")
    if policy.simulate_only and protocol != "simulate":
        raise ConfigError(f"policy {policy.name!r} exists only in the simulate protocol: use protocol=simulate")
    if kernels not in KERNELS:
        raise ConfigError(f"kernels={kernels!r}: use one of {', '.join(KERNELS)}")


def check_kernels(kernels: str, device_type: str) -> None:
    """Refuse ``kernels=triton`` where Triton cannot run: it needs CUDA, or its interpreter for tests."""
    if kernels == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"kernels=triton needs a CUDA device, not {device_type}: use kernels=auto (TRITON_INTERPRET=1 runs "
            "the kernels in Triton's interpreter, for tests)"
        )
