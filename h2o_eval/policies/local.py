from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from h2o_eval.policies.base import Policy


@dataclass(frozen=True)
class Local(Policy):
    """Only the most recent tokens: a sliding window of C (every slot protected, recency decides)."""

    name: ClassVar[str] = "local"
