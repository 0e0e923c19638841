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

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from enum import Enum, IntEnum
from typing import Any, ClassVar

import torch

from h2o_eval.checks import check_budget
from h2o_eval.errors import ConfigError
from h2o_eval.policies.inputs import Prompt, Rehearsal, Script

PROTOCOLS = ("simulate", "prefill", "context", "turns")
# protocol=turns: what a turn leaves in the cache, and when the cache is compressed (h2o_eval.generation.Turns)
HISTORIES = ("gold", "own")
SCHEDULES = ("once", "nested", "new_turn")
# After a prefill/context compression: evict = the policy's own rule (evicting policies keep evicting one token per
# arriving token); grow = nothing is evicted after the compression (kvpress's pipeline, whose presses act once);
# interval = nothing is evicted by an arriving token, and every ``compression_interval`` forwards the cache is
# compressed by a policy's scores (:class:`Interval`: kvpress's DecodingPress).
DECODINGS = ("evict", "grow", "interval")
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


class Votes(str, Enum):
    """Which query rows' attention feeds the scores."""

    ALL = "all"  # every row, the prompt's and every later token's
    WINDOW = "window"  # the prompt's last ``window`` rows
    NONE = "none"  # no row: scores come from :meth:`Policy.key_scores`, or recency alone decides


class Combine(str, Enum):
    """How a vote meets the score it finds."""

    ADD = "add"  # votes accumulate (H2O)
    REPLACE = "replace"  # the latest vote is the score (TOVA)


class Pooling(str, Enum):
    """How a compressed prompt's scores are pooled along positions (as torch's max_pool1d / avg_pool1d)."""

    MAX = "max"
    AVG = "avg"


class Heads(str, Enum):
    """Whose votes a KV head counts."""

    KV = "kv"  # its own query heads': each KV head keeps its own tokens
    LAYER = "layer"  # every query head of the layer: the layer's KV heads keep one set of tokens


class DecodeVote(IntEnum):
    """What an arriving token past the prompt does to the scores (the code every kernel reads)."""

    ADD = 0  # adds its attention
    REPLACE = 1  # replaces the scores with its attention
    NONE = 2  # nothing (window votes belong to the prompt; no votes at all)


def _member(owner: str, name: str, kind: type[Enum], value: Any) -> Any:
    """``value`` as a member of ``kind``, or a one-line refusal naming the valid values."""
    try:
        return kind(value)
    except ValueError:
        valid = ", ".join(member.value for member in kind)
        raise ConfigError(f"{owner}: {name}={value!r}: use one of {valid}") from None


@dataclass(frozen=True)
class Rule:
    """How scores are made and used: the data every implementation of the mechanism reads.

    Args:
        votes: which query rows' attention (summed over the KV head's query heads, see ``heads``) feeds the
            scores (:class:`Votes`: all rows, the prompt's last ``window`` rows, or none).
        combine: :class:`Combine`: votes add up (H2O) or the latest replaces the score (TOVA).
        window: the voting rows of ``votes="window"``.
        pooling: ``None`` or a :class:`Pooling`: when a prompt is compressed, the scores of the tokens older than
            the protected recent window are pooled along positions like torch's ``max_pool1d`` / ``avg_pool1d``
            (stride 1, padding ``kernel_size // 2``).
        kernel_size: the pooling window (odd).
        grows: after the prompt is compressed every later token is kept (the SnapKV family, as their papers
            run them); otherwise each arriving token evicts one once the cache holds C.
        safeguard: ``None``: each KV head keeps its own C. A share in [0, 1]: when a prompt is compressed, the
            layer's Hkv * C slots go to the best scores of all its KV heads together, each head guaranteed its
            protected tokens and its floor(safeguard * C) best (Ada-KV); heads then hold different numbers.
        heads: :class:`Heads`: each KV head counts its own query heads' votes and keeps its own tokens, or every
            KV head gets the votes of all the layer's query heads summed, so the heads of a layer, starting alike
            (an empty cache, one capacity), keep one set of tokens (TOVA as its authors run it).
        threshold: ``None``: a prompt is compressed to C. A number: a score threshold instead of C (kvpress's
            DMSPress): when a prompt is compressed, each unprotected token scoring below it goes, whatever C;
            heads then hold different numbers of tokens.
        drops: with ``threshold``, also at the end of every later forward: each held token that has left the
            protected recent window by then and scores below the threshold goes (its slot is freed).

    String values are accepted and checked (``Rule(votes="windw")`` is refused in one line).
    """

    votes: Votes = Votes.NONE
    combine: Combine = Combine.ADD
    window: int = 0
    pooling: Pooling | None = None
    kernel_size: int = 1
    grows: bool = False
    safeguard: float | None = None
    heads: Heads = Heads.KV
    threshold: float | None = None
    drops: bool = False

    def __post_init__(self) -> None:
        for name, kind in (("votes", Votes), ("combine", Combine), ("heads", Heads), ("pooling", Pooling)):
            value = getattr(self, name)
            if value is not None or name != "pooling":
                object.__setattr__(self, name, _member("Rule", name, kind, value))
        check_number("Rule", "window", self.window, integer=True, low=0)
        check_number("Rule", "kernel_size", self.kernel_size, integer=True, low=1)
        if self.safeguard is not None:
            check_number("Rule", "safeguard", self.safeguard, low=0, high=1)
        if self.threshold is not None:
            check_number("Rule", "threshold", self.threshold)
        check_flag("Rule", "drops", self.drops)
        if self.threshold is not None and not self.grows:
            raise ConfigError("Rule: threshold=T keeps every token it spares after the prompt: add grows=True")
        if self.drops and self.threshold is None:
            raise ConfigError("Rule: drops=True drops tokens below a threshold: give threshold=T")

    @property
    def decode_votes(self) -> DecodeVote:
        """What an arriving token past the prompt does to the scores."""
        if self.votes != Votes.ALL:
            return DecodeVote.NONE
        return DecodeVote.ADD if self.combine == Combine.ADD else DecodeVote.REPLACE

    def prompt_weights(self, prompt_rows: torch.Tensor) -> torch.Tensor | None:
        """[B, n] float: how much each prompt row's attention counts in the scores at compression (``prompt_rows``
        [B, n] bool marks the real rows of each sequence's prompt); None when no row votes."""
        if self.votes == Votes.NONE:
            return None
        from_end = prompt_rows.flip(-1).cumsum(-1).flip(-1)  # 1 on a prompt's last real row, 2 before it, ...
        voters = self.window if self.votes == Votes.WINDOW else prompt_rows.shape[-1]
        if self.combine == Combine.REPLACE:
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


def check_flag(owner: str, name: str, value: Any) -> None:
    """Refuse a setting that must be true or false, in one line."""
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}: {name}={value!r}: use true or false")


@dataclass(frozen=True)
class Policy:
    """Base class: a budget and the rule that fills the unprotected slots.

    Args:
        budget: fraction of the sequence in (0, 1], or an integer number of tokens >= 1.
        rounding: how a fraction budget becomes C (:data:`~h2o_eval.checks.ROUNDINGS`): ``up`` = ceil(budget *
            length), ``down`` = int(budget * length) as kvpress rounds its kept count; C is at least 1.
    """

    budget: float | int = 0.2
    rounding: str = "up"
    name: ClassVar[str]
    # The protocols the policy exists in (docs/policies.md): simulate, prefill, context.
    protocols: ClassVar[tuple[str, ...]] = PROTOCOLS
    # Parameters (besides the budget) under which the generic test suites run the policy on tiny models and short
    # sequences; every registered policy takes part in every suite its protocols allow.
    example: ClassVar[dict[str, Any]] = {}
    # Whether the policy scores what a cache holds later (:meth:`held_scores`: by default its compression scores,
    # which then read only the prompt's keys, values and real tokens), as an interval compression does
    # (``decoding=interval``; kvpress's DecodingPress).
    scores_held: ClassVar[bool] = False
    # For such a policy, the forwards whose attention inputs :meth:`held_scores` reads (kvpress's DecodingPress keeps
    # the hidden states of the last 256); 0: none.
    held_forwards: ClassVar[int] = 0

    def __post_init__(self) -> None:
        check_budget(self.budget, self.rounding)

    @property
    def rule(self) -> Rule:
        return Rule()

    def capacity(self, length: int) -> int:
        """C for a sequence of ``length`` tokens (fractions round as ``rounding`` says, and C is never below 1)."""
        if isinstance(self.budget, float):
            if self.rounding == "down":
                return max(1, int(self.budget * length))
            return max(1, math.ceil(self.budget * length - 1e-9))
        return self.budget

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        """The layout of ``layer`` (of ``num_layers``) for a sequence of ``length`` tokens."""
        capacity = self.capacity(length)
        return Plan(capacity=capacity, recent=capacity)

    def key_scores(self, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor | None:
        """Scores that need no attention, computed once per token as it arrives: key [B, Hkv, n, D] and its
        positions [B, Hkv, n] -> [B, Hkv, n] float32; None: scores start at 0."""
        return self.position_scores(position, layer)

    def position_scores(self, position: torch.Tensor, layer: int) -> torch.Tensor | None:
        """Scores of :meth:`key_scores` that depend on the token's position alone (positions [B, Hkv, n] ->
        [B, Hkv, n] float32): decode steps then read them from a table made ahead for the next positions, instead of
        computing them one token at a time. None: no such scores."""
        return None

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor | None:
        """The scores [B, Hkv, n] a prompt is compressed by, from what its layer saw of it (``prompt``) and the
        scores the rule made (``scores``: votes pooled, or key scores); ``protected`` [B, Hkv, n] marks the tokens
        kept whatever their score. None: those scores as they are."""
        return None

    def held_scores(self, held: Prompt, heads: torch.Tensor) -> torch.Tensor:
        """[1, h, n] the scores of what the KV heads ``heads`` [h] of one sequence hold, in position order (``held``:
        their keys and values, all real; its ``hidden_states``, the attention inputs of the last ``held_forwards``
        forwards, and ``query``, no rows of every query head), as an interval compression scores them
        (``scores_held``); by default the prompt's compression scores."""
        return self.compression_scores(held, torch.zeros(held.key.shape[:-1]), held.real.new_zeros(1, 1, 1))

    def rescore_held(
        self,
        scores: torch.Tensor,
        protected: torch.Tensor,
        values: torch.Tensor,
        held: torch.Tensor,
        capacity: torch.Tensor,
        module: torch.nn.Module | None,
    ) -> torch.Tensor:
        """The scores [B, Hkv, S] an interval compression keeps a layer's slots by, from its scorer's ``scores``
        (pooled; ``protected`` [B, Hkv, S] marks the tokens kept whatever their score), the slots' ``values``
        [B, Hkv, S, D] and ``held`` mask, the target ``capacity`` [B, Hkv] and the attention module: by default the
        scores as they are."""
        return scores

    def at_budget(self, budget: float | int) -> Policy:
        """This policy at another budget."""
        return dataclasses.replace(self, budget=budget)

    def passes(self, script: Script) -> list[list[list[int]]]:
        """Extra passes fed after the prompt and before its compression, whose keys and values are dropped again:
        per pass, per sequence its token ids (empty: that sequence has no such pass). Their queries score the
        prompt's tokens (:meth:`rehearse`), and the prompt is then compressed by those scores."""
        return []

    def rehearse(self, rehearsal: Rehearsal, scores: torch.Tensor) -> torch.Tensor:
        """The compression scores [B, Hkv, S] after one extra pass, from what it showed the layer and the scores
        after the earlier passes (``scores``, 0 before the first). Neither the passes nor their scores may read the
        budget (:meth:`rehearsal_identity`)."""
        raise NotImplementedError(f"policy {self.name!r} declares passes but does not rehearse them")

    def rehearsal_identity(self) -> str:
        """What the extra passes and their scores depend on: the policy as built without its budget and rounding,
        which only choose how many of the scored tokens stay. Caches of one prompt whose policies have one identity
        can share one run of the passes (:func:`h2o_eval.generation.settle`'s ``siblings``)."""

        def strip(described: dict[str, Any]) -> dict[str, Any]:
            return {
                key: strip(value) if isinstance(value, dict) else value
                for key, value in described.items()
                if key not in ("budget", "rounding")
            }

        return json.dumps(strip(self.describe()), sort_keys=True, default=str)

    @property
    def needs_answer(self) -> bool:
        """Whether the passes are built from the full cache's answer (:attr:`Script.answer`): not deployable."""
        return False

    def allocate(
        self, scores: list[torch.Tensor], held: list[torch.Tensor], capacities: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """After extra passes: every layer's C [B, Hkv] chosen across layers from all the layers' compression
        scores [B, Hkv, S] over their ``held`` slots and their planned ``capacities`` (a model-wide selection,
        KVzip's default); None: each layer keeps its own plan."""
        return None

    def attention(self, query, key, value, valid, scaling) -> torch.Tensor | None:
        """A policy that is no eviction cache at all (the authors' H2O simulation) computes the attention
        itself: output [B, Hq, T, D]. None: the mechanism does."""
        return None

    @property
    def positional(self) -> bool:
        """Whether the policy has scores of the position alone (:meth:`position_scores`)."""
        return type(self).position_scores is not Policy.position_scores

    @property
    def keyed(self) -> bool:
        """Whether the policy scores an arriving key by more than its position (:meth:`key_scores`)."""
        return type(self).key_scores is not Policy.key_scores

    @property
    def rescores(self) -> bool:
        """Whether the policy scores a prompt at its compression (:meth:`compression_scores`)."""
        return type(self).compression_scores is not Policy.compression_scores

    @property
    def rerotates(self) -> bool:
        """Whether the keys a compressed prompt kept are re-rotated to contiguous positions (kvpress's key
        re-rotation, :mod:`h2o_eval.rerotation`)."""
        return False

    @property
    def rehearses(self) -> bool:
        """Whether the policy scores a prompt by extra passes (:meth:`passes`) before compressing it."""
        return type(self).passes is not Policy.passes

    @property
    def ranks_tokens(self) -> bool:
        """Whether scores rank the unprotected tokens (attention votes, key scores, compression scores or extra
        passes): what a policy that hands out slots by score (Ada-KV, CriticalKV) needs of its base."""
        return self.rule.votes != Votes.NONE or self.keyed or self.positional or self.rescores or self.rehearses

    @property
    def has_cache(self) -> bool:
        """Whether the policy runs as a cache (and so can generate): not if it computes its own attention."""
        return type(self).attention is Policy.attention

    def describe(self) -> dict[str, Any]:
        """The policy as built: its name and every field, a wrapped base policy described the same way. A record's
        identity covers it, so a changed default is a new setting, never a reused record."""
        described: dict[str, Any] = {"name": self.name}
        for field in fields(self):
            value = getattr(self, field.name)
            described[field.name] = value.describe() if isinstance(value, Policy) else value
        return described


@dataclass(frozen=True)
class PromptScorer(Policy):
    """A policy that scores a prompt once, when it is compressed (:meth:`Policy.compression_scores`), and keeps every
    later token, as kvpress's ScorerPress does: no votes while decoding, nothing protected unless :meth:`plan` says
    otherwise. Prefill and context protocols only."""

    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")

    @property
    def rule(self) -> Rule:
        return Rule(grows=True)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=0)


def check_protocol(policy: Policy, protocol: str, kernels: str) -> None:
    """Refuse a protocol or kernel choice that does not exist, or that this policy cannot run."""
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={protocol!r}: use one of {', '.join(PROTOCOLS)}")
    if (protocol if protocol != "turns" else "context") not in policy.protocols:  # turns compress a context
        raise ConfigError(
            f"policy {policy.name!r} exists only in the {' and '.join(policy.protocols)} protocol"
            f"{'s' if len(policy.protocols) > 1 else ''}: use protocol={policy.protocols[0]}"
        )
    if kernels not in KERNELS:
        raise ConfigError(f"kernels={kernels!r}: use one of {', '.join(KERNELS)}")


def check_decoding(protocol: str, decoding: str, policy: Policy | None = None) -> None:
    """Refuse a decoding rule that does not exist, ``grow`` or ``interval`` where nothing is compressed (simulate),
    or either for a ``policy`` that drops tokens while decoding (a threshold's ``decoding=true``)."""
    if decoding not in DECODINGS:
        raise ConfigError(f"decoding={decoding!r}: use one of {', '.join(DECODINGS)}")
    if decoding != "evict" and policy is not None and policy.rule.drops:
        raise ConfigError(
            f"policy {policy.name!r} drops tokens below its threshold while decoding, and decoding={decoding} "
            "decides what later tokens stay: use decoding=evict (or policy.decoding=false)"
        )
    if decoding != "evict" and protocol == "simulate":
        kept = "keeps every token" if decoding == "grow" else "compresses every N forwards"
        raise ConfigError(
            f"decoding={decoding} {kept} after a prompt's compression, and simulate compresses none: use "
            "protocol=prefill or context (or decoding=evict)"
        )


@dataclass(frozen=True)
class Interval:
    """``decoding=interval`` (kvpress's DecodingPress, CompressionRatioDecodingPress and, with ``policy``,
    PrefillDecodingPress): after the prompt's compression nothing is evicted by an arriving token; every
    ``compression_interval`` forwards after the prompt (a chunk such as the question counts one, as each generated
    token), and after a chunk of at least the target's tokens, each (sequence, layer, KV head) is compressed to the
    target by ``policy``'s scores over everything it holds, before the next forward. The steps between are captured
    as CUDA graphs when ``policy`` does not vote (its key scores, or its scores of what is held; each compression
    lays the buffers out anew, and the step after it is captured again); a policy that votes keeps each step's
    attention input, so its steps run eagerly.

    Args:
        compression_interval: forwards between two compressions (kvpress's ``compression_interval``).
        target_size: the tokens each KV head keeps (kvpress's ``target_size``), 2048 if neither target is given.
        target_ratio: instead, the share of the tokens seen so far that goes, kvpress's
            ``target_compression_ratio`` in [0, 1): each compression keeps max(1, int(seen * (1 - target_ratio))).
        policy: whose scores and layout (recent window, sinks, at the target) choose the tokens kept; None: the
            cache's own policy. Its budget is not read.
    """

    compression_interval: int = 512
    target_size: int | None = None
    target_ratio: float | None = None
    policy: Policy | None = None

    def __post_init__(self) -> None:
        check_number("decoding=interval", "compression_interval", self.compression_interval, integer=True, low=1)
        if self.target_size is not None and self.target_ratio is not None:
            raise ConfigError("decoding=interval: give target_size or target_ratio, not both (set the other to null)")
        if self.target_size is not None:
            check_number("decoding=interval", "target_size", self.target_size, integer=True, low=1)
        ratio = self.target_ratio
        if ratio is not None and (not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 <= ratio < 1):
            raise ConfigError(f"decoding=interval: target_ratio={ratio!r}: use a fraction in [0, 1)")
        if self.policy is not None:
            refuse_interval_policy(self.policy)

    def layout(self, policy: Policy, seen: int, layer: int, num_layers: int) -> Plan:
        """The layout a compression keeps once ``seen`` tokens were fed: C = the target, and the recent window and
        sinks ``policy`` (the decoding policy) plans at that C; none for a policy that scores what is held
        (``scores_held``), whose scores keep its sinks and newest tokens, as kvpress's ScorerPress keeps its top
        scores."""
        target = self.target(seen)
        if policy.scores_held:
            return Plan(capacity=target, recent=0, sinks=0)
        plan = policy.at_budget(target).plan(target, layer, num_layers)
        return Plan(capacity=target, recent=min(plan.recent, target), sinks=min(plan.sinks, target))

    def target(self, seen: int) -> int:
        """The tokens a KV head keeps after a compression once ``seen`` tokens were fed (the longest sequence's)."""
        if self.target_ratio is not None:
            return max(1, int(seen * (1 - self.target_ratio)))
        return 2048 if self.target_size is None else self.target_size

    def describe(self) -> dict[str, Any]:
        return {
            "compression_interval": self.compression_interval,
            "target_size": self.target_size,
            "target_ratio": self.target_ratio,
            "policy": None if self.policy is None else self.policy.describe(),
        }


def refuse_interval_policy(
    policy: Policy, setting: str = "decoding=interval", compression: str = "an interval", otherwise: str = ""
) -> None:
    """Refuse a policy whose scores an interval compression cannot make: it scores only by key scores, by the
    attention of the queries fed since the last compression and by what is held (``scores_held``); a wrapper
    only if it declares it can (``interval_ready``: ``adakv``, ``criticalkv``) and over such a base. The refusal
    names the ``setting`` that asks for such a compression, whose ``compression`` it is (``protocol=turns``'
    compression of a turn makes the same scores) and ``otherwise``, a fix besides another policy."""
    if any(field.name == "base" for field in fields(policy)):
        if not getattr(policy, "interval_ready", False):
            raise ConfigError(
                f"{setting}: policy {policy.name!r} wraps a base policy in a way {compression} compression "
                f"does not make: use its base (e.g. snapkv, knorm), or adakv or criticalkv over it{otherwise}"
            )
        refuse_interval_policy(policy.base, setting, compression, otherwise)
        return
    if policy.rescores and not policy.scores_held or policy.rehearses or not policy.has_cache:
        raise ConfigError(
            f"{setting}: policy {policy.name!r} scores a prompt by its own pass over it, which {compression} "
            "compression has not: use a policy scored by key scores, attention votes or the held keys and values "
            "(knorm, snapkv, h2o, tova, keydiff, cur, lagkv, expected_attention, observed_attention, random, "
            f"streaming){otherwise}"
        )


def check_kernels(kernels: str, device_type: str) -> None:
    """Refuse ``kernels=triton`` where Triton cannot run: it needs CUDA, or its interpreter for tests."""
    if kernels == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"kernels=triton needs a CUDA device, not {device_type}: use kernels=auto (TRITON_INTERPRET=1 runs "
            "the kernels in Triton's interpreter, for tests)"
        )
