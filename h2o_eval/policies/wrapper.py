from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Heads, Plan, Policy, Rule
from h2o_eval.policies.inputs import Prompt, Rehearsal, Script


@dataclass(frozen=True)
class Wrapper(Policy):
    """A policy over a ``base`` policy: everything is the base's (its budget, layout, rule, scores, extra passes)
    except what the wrapper overrides. A base qualifies by what it declares it can do (:meth:`refusal`), not by
    its name. Prefill and context protocols only (the wrappers change how a prompt is compressed)."""

    base: Policy | None = None
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")
    # Whether the wrapper chooses the kept tokens itself, its scores only marking them (no base to another wrapper).
    selects: ClassVar[bool] = False
    # The base make_policy builds when none is named, and the parameters it gives that base.
    default_base_name: ClassVar[str]
    default_base_params: ClassVar[dict[str, Any]] = {}
    # The budget make_policy builds the base at whatever budget it is given (None: that budget): ``dms``'s 1.0, as
    # a threshold decides what stays and a scorer press in kvpress's DMSPress keeps its compression ratio of 0.
    base_budget: ClassVar[float | None] = None
    # Whether the wrapper can be the decoding policy of ``decoding=interval`` over a base that can: its base scores
    # what is held, and the wrapper changes how the scores fill the target (:meth:`rescore_held`, the rule).
    interval_ready: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.base is None:
            object.__setattr__(self, "base", self.default_base())
        if (reason := self.refusal(self.base)) is not None:
            raise ConfigError(f"{self.name}: base={self.base.name!r} {reason}")
        object.__setattr__(self, "budget", self.base.budget)
        object.__setattr__(self, "rounding", self.base.rounding)
        super().__post_init__()

    def default_base(self) -> Policy:
        from h2o_eval.policies import make_policy

        budget = self.budget_of_base(self.budget)
        return make_policy(self.default_base_name, budget, rounding=self.rounding, **self.default_base_params)

    @classmethod
    def budget_of_base(cls, budget: float | int) -> float | int:
        """The budget the base is built at when the wrapper is given ``budget``: :attr:`base_budget`, if set."""
        return budget if cls.base_budget is None else cls.base_budget

    @classmethod
    def refusal(cls, base: Policy) -> str | None:
        """Why ``base`` cannot be wrapped (None: it can): it needs a cache and scores that rank the unprotected
        tokens of each KV head."""
        if not base.has_cache:
            return "computes its own attention and holds no cache: use a scoring policy such as snapkv"
        if not base.ranks_tokens:
            return "ranks no tokens by score (recency alone decides): use a scoring policy such as snapkv"
        if base.rule.heads == Heads.LAYER:
            return (
                "with heads=layer keeps one token set per layer, which per-head shares cannot change: add heads=kv "
                "(+policy.heads=kv on the command line)"
            )
        if isinstance(base, cls):
            return f"is already a {cls.name}: use its base"
        if isinstance(base, Wrapper) and base.selects:
            return "chooses its kept tokens itself and has no scores to rank them by: wrap a scoring policy"
        return None

    @property
    def rule(self) -> Rule:
        return self.base.rule

    def capacity(self, length: int) -> int:
        return self.base.capacity(length)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return self.base.plan(length, layer, num_layers)

    def key_scores(self, key: torch.Tensor, position: torch.Tensor, layer: int) -> torch.Tensor | None:
        return self.base.key_scores(key, position, layer)

    def position_scores(self, position: torch.Tensor, layer: int) -> torch.Tensor | None:
        return self.base.position_scores(position, layer)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor | None:
        return self.base.compression_scores(prompt, scores, protected)

    @property
    def scores_held(self) -> bool:
        return self.base.scores_held

    @property
    def held_forwards(self) -> int:
        return self.base.held_forwards

    def held_scores(self, held: Prompt, heads: torch.Tensor) -> torch.Tensor:
        return self.base.held_scores(held, heads)

    def rescore_held(
        self,
        scores: torch.Tensor,
        protected: torch.Tensor,
        values: torch.Tensor,
        held: torch.Tensor,
        capacity: torch.Tensor,
        module: torch.nn.Module | None,
    ) -> torch.Tensor:
        return self.base.rescore_held(scores, protected, values, held, capacity, module)

    def at_budget(self, budget: float | int) -> Policy:
        return dataclasses.replace(self, base=self.base.at_budget(self.budget_of_base(budget)))

    @property
    def positional(self) -> bool:
        return self.base.positional

    @property
    def keyed(self) -> bool:
        return self.base.keyed

    @property
    def rescores(self) -> bool:
        return self.base.rescores

    def passes(self, script: Script) -> list[list[list[int]]]:
        return self.base.passes(script)

    @property
    def rerotates(self) -> bool:
        return self.base.rerotates

    @property
    def rehearses(self) -> bool:
        return self.base.rehearses

    def rehearse(self, rehearsal: Rehearsal, scores: torch.Tensor) -> torch.Tensor:
        return self.base.rehearse(rehearsal, scores)

    @property
    def needs_answer(self) -> bool:
        return self.base.needs_answer

    def allocate(
        self, scores: list[torch.Tensor], held: list[torch.Tensor], capacities: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        return self.base.allocate(scores, held, capacities)
