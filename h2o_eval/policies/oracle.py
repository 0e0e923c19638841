from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_eval.policies.base import Plan, Policy, Rule
from h2o_eval.policies.inputs import Rehearsal, Script


@dataclass(frozen=True)
class Oracle(Policy):
    """The ceiling of compressing a prompt once: keep the tokens the queries that will read the compressed cache
    attend to most. Not deployable: it reads the future.

    For each sequence the full cache first generates the answer (greedily, as the evaluation does; under
    ``protocol=context`` from a copy of the uncompressed context, so exactly the full cache's answer); then, in an
    extra pass fed after the prompt and dropped again, the question (``protocol=context``: it follows the
    compressed context) and that answer, teacher-forced, attend with the full cache; each prompt token's score is
    the attention those queries give it, summed over the queries and the KV head's query heads. The prompt is then
    compressed to C by those scores, the newest token kept as every policy keeps it, and the evaluation goes on as
    for any policy. Under ``prefill`` the question is inside the compressed prompt, and its queries attended in
    full before the compression: only the answer's queries read the compressed cache, so only they score. A score
    between the full cache's and the oracle's is a gap a query-agnostic scorer could still close; below local or
    random, the scorer's fault. Prefill and context protocols only.
    """

    name: ClassVar[str] = "oracle"
    protocols: ClassVar[tuple[str, ...]] = ("prefill", "context")

    @property
    def rule(self) -> Rule:
        return Rule(grows=True)

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=1)

    @property
    def needs_answer(self) -> bool:
        return True

    def passes(self, script: Script) -> list[list[list[int]]]:
        return [[question + answer for question, answer in zip(script.question, script.answer, strict=True)]]

    def rehearse(self, rehearsal: Rehearsal, scores: torch.Tensor) -> torch.Tensor:
        votes = rehearsal.probabilities()[..., : rehearsal.slots].sum(dim=(2, 3))  # [B, Hkv, S]
        return scores + votes.masked_fill(~rehearsal.held, 0.0)
