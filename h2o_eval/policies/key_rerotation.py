from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from h2o_eval.policies.base import Policy
from h2o_eval.policies.wrapper import Wrapper


@dataclass(frozen=True)
class KeyRerotation(Wrapper):
    """Key re-rotation (kvpress's ``KeyRerotationPress``, as FINCH and StreamingLLM re-rotate): the ``base`` policy
    compresses the prompt, then each KV head's kept keys are rotated back from their tokens' positions and
    re-rotated to contiguous ones, so that the evicted tokens leave no gap in the positions the model sees.

    A KV head that keeps n of the prompt's tokens sees them, in their order, at the n positions that end at the
    prompt's last token, and every later token keeps its own position (:mod:`h2o_eval.rerotation`). kvpress puts them
    at 0..n-1 and its pipeline continues the question from n: every query sees every kept key at the same distance
    either way. Everything else (budget, scores, what happens after the prompt) is the base's; the cache's
    positions stay its tokens' (recency, sinks, position scores and the kept tokens reported read them), and under
    ``decoding=evict`` tokens evicted after the prompt leave gaps again, as in any cache. Prefill and context
    protocols, on a model whose rotary the config describes and turns whole heads; the prompt is fed alone, so not
    on log-likelihood tasks (their one forward holds the prompt and what follows it).

    Args:
        base: the policy that compresses the prompt (a :class:`Policy`; ``make_policy("key_rerotation",
            base="knorm")`` builds it from its name and parameters).
    """

    name: ClassVar[str] = "key_rerotation"
    default_base_name: ClassVar[str] = "snapkv"
    # The generic suites run it over H2O, whose decoding=evict keeps evicting after the re-rotated prompt.
    example: ClassVar[dict[str, Any]] = {"base": "h2o"}

    @classmethod
    def refusal(cls, base: Policy) -> str | None:
        """Why ``base`` cannot be wrapped (None: it can): it needs a cache, and keys that are not re-rotated yet."""
        if not base.has_cache:
            return "computes its own attention and holds no cache: use a policy that compresses a prompt (snapkv)"
        if base.rerotates:
            return "re-rotates its kept keys already: use it alone"
        return None

    @property
    def rerotates(self) -> bool:
        return True
