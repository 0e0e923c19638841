from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import Policy
from h2o_eval.policies.chunkkv import press_scores
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.segments import Selecting, best, layered, piece, piece_scores
from h2o_eval.policies.wrapper import Wrapper


@dataclass(frozen=True)
class Composed(Selecting):
    """kvpress's ``ComposedPress`` of two presses: the base compresses the prompt, then the policy ``then``
    compresses what the base kept.

    The base keeps its C1 of the prompt (its budget, the run's; ``rounding=down``: kvpress's int(length * (1 -
    ratio))), chosen by the scores kvpress's press of it gives (its protected tokens first). Each KV head's kept
    tokens are then scored by ``then`` as a prompt of their own (their keys, values and hidden states; its protected
    tokens those of a prompt of C1 tokens) and its C of C1 stay (``then_budget``, or the run's budget). So C =
    C_then(C1(length)), and the fraction kept is the product of the two budgets: kvpress's compression_ratio of a
    ComposedPress is 1 - (1 - ratio1)(1 - ratio2). ``then`` is any policy that scores keys, values or hidden states
    (not attention votes: kvpress would hand it the prompt's attention, not the kept tokens'), built with its
    default parameters. Where it differs from kvpress: the kept tokens reach ``then`` in position order (kvpress: in
    the base's score order; a ``then`` whose scores depend on the order, such as one protecting first tokens, then
    differs), and ties keep the newest token (kvpress: ``torch.topk``'s order). Prefill and context only.

    Args:
        base: the first policy (default ``snapkv``; any scoring policy that is not a wrapper).
        then: the second policy's name (default ``knorm``).
        then_budget: the second policy's budget, a fraction of what the first kept or a token count (None: the
            run's budget).
    """

    then: str = "knorm"
    then_budget: float | int | None = None
    # The second policy as built from ``then`` (described with the policy, so a changed default of it is a new
    # setting).
    second: Policy | None = field(default=None, init=False)
    name: ClassVar[str] = "composed"
    default_base_name: ClassVar[str] = "snapkv"
    example: ClassVar[dict[str, Any]] = {"window": 4}

    def __post_init__(self) -> None:
        super().__post_init__()
        from h2o_eval.policies import POLICIES, example_policy, make_policy

        if self.then not in POLICIES or Selecting.refusal(example_policy(self.then)):
            valid = [n for n in POLICIES if not Selecting.refusal(example_policy(n))]
            raise ConfigError(f"{self.name}: then={self.then!r}: use one of {', '.join(valid)}")
        budget = self.budget if self.then_budget is None else self.then_budget
        try:
            second = make_policy(self.then, budget, rounding=self.rounding)
        except ConfigError:
            raise ConfigError(
                f"{self.name}: then_budget={self.then_budget!r}: use a fraction in (0, 1] or a token count >= 1"
            ) from None
        object.__setattr__(self, "second", second)

    @classmethod
    def refusal(cls, base: Policy) -> str | None:
        if isinstance(base, Wrapper):
            return "is a wrapper: use a scoring policy (kvpress's ScorerPress)"
        if layered(base):
            return "gives its layers capacities of their own: use a policy with one capacity"
        return super(Selecting, cls).refusal(base)

    def first(self, length: int) -> int:
        """C1: what the base keeps of a ``length``-token prompt."""
        return min(length, self.base.capacity(length))

    def capacity(self, length: int) -> int:
        kept = self.first(length)
        return min(kept, self.second.capacity(kept))

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        return super().compression_scores(prompt, press_scores(self.base, prompt, scores), protected)

    def chosen(self, prompt: Prompt, scores: torch.Tensor, row: int, real: torch.Tensor) -> torch.Tensor:
        length = real.numel()
        first, count = self.first(length), self.capacity(length)
        chosen = torch.zeros(scores.shape[1], length, dtype=torch.bool, device=scores.device)
        for head in range(scores.shape[1]):
            kept = best(scores[row, head, real], first).sort().values
            found = piece_scores(self.second, piece(prompt, row, real[kept], count, head))[0, 0]
            chosen[head, kept[best(found, count)]] = True
        return chosen
