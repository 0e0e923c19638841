"""kvpress's wrappers that compress a prompt piece by piece (``chunk``: ChunkPress; ``block``: BlockPress), and what
they share with ``composed`` (ComposedPress): a base policy scoring a piece of the prompt as if the piece were the
whole prompt (:func:`piece_scores`), and a selection the mechanism then keeps exactly (:class:`Selecting`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.policies.base import Plan, Policy, Rule, Votes, check_number
from h2o_eval.policies.chunkkv import press_scores
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.wrapper import Wrapper


def piece(prompt: Prompt, row: int, columns: torch.Tensor, capacity: int, head: int | None = None) -> Prompt:
    """Sequence ``row`` of ``prompt`` restricted to ``columns`` [m] (in position order), all its KV heads or only
    ``head`` (with that head's query heads), as a prompt of its own whose C is ``capacity``: what kvpress hands a
    press's ``score`` when it scores a chunk, a block or what an earlier press kept."""
    kv = slice(None) if head is None else slice(head, head + 1)
    group = prompt.group
    queries = slice(None) if head is None else slice(head * group, (head + 1) * group)
    key = prompt.key[row : row + 1, kv][:, :, columns]
    return Prompt(
        module=prompt.module,
        layer=prompt.layer,
        query=prompt.query[row : row + 1, queries][:, :, columns],
        key=key,
        value=prompt.value[row : row + 1, kv][:, :, columns],
        position=prompt.position[row : row + 1, columns],
        real=torch.ones(1, columns.numel(), dtype=torch.bool, device=columns.device),
        capacity=torch.full(key.shape[:2], capacity, dtype=torch.int64, device=columns.device),
        hidden_states=None if prompt.hidden_states is None else prompt.hidden_states[row : row + 1, columns],
        rotary=prompt.rotary,
        scaling=prompt.scaling,
    )


def piece_scores(base: Policy, part: Prompt) -> torch.Tensor:
    """[1, h, m] the scores ``base`` gives a piece of a prompt (:func:`piece`) as kvpress's press of it scores the
    piece: its key scores, then its own scorer, its protected tokens (of a prompt of the piece's length) first."""
    position = part.position.unsqueeze(1).expand(-1, part.key.shape[1], -1)
    scores = base.key_scores(part.key, position, part.layer)
    if scores is None:
        scores = torch.zeros(position.shape, dtype=torch.float32, device=position.device)
    return press_scores(base, part, scores.float())


def best(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the ``count`` best of ``scores`` [..., m], best first; of tied scores the newest (the
    mechanism's rule)."""
    last = scores.shape[-1] - 1
    return last - torch.argsort(scores.flip(-1), dim=-1, descending=True, stable=True)[..., :count]


def layered(policy: Policy) -> bool:
    """Whether ``policy`` gives its layers capacities of their own (PyramidKV)."""
    return policy.plan(1000, 0, 2) != policy.plan(1000, 1, 2)


def piece_refusal(base: Policy) -> str | None:
    """Why ``base`` cannot score a piece of a prompt alone (None: it can)."""
    if isinstance(base, Wrapper):
        return "is a wrapper: use a scoring policy (kvpress's ScorerPress)"
    if base.rule.votes != Votes.NONE or base.rehearses:
        return (
            "scores by the attention of the whole prompt (or extra passes), which a piece of it cannot recompute: "
            "use a policy that scores keys, values or hidden states, such as keydiff, knorm or expected_attention"
        )
    if layered(base):
        return "gives its layers capacities of their own: use a policy with one capacity"
    return None


@dataclass(frozen=True)
class Selecting(Wrapper):
    """A wrapper that chooses the kept tokens of each sequence and KV head itself (:meth:`chosen`); C is what it
    keeps, fixed by the lengths alone, so the mechanism keeps exactly its choice. Nothing is protected beyond it,
    and every later token is kept (kvpress's presses act once)."""

    selects: ClassVar[bool] = True

    @classmethod
    def refusal(cls, base: Policy) -> str | None:
        return piece_refusal(base) or super().refusal(base)

    @property
    def rule(self) -> Rule:
        return dataclasses.replace(self.base.rule, pooling=None, kernel_size=1, grows=True)

    @property
    def rescores(self) -> bool:
        return True

    def plan(self, length: int, layer: int = 0, num_layers: int = 1) -> Plan:
        return Plan(capacity=self.capacity(length), recent=0)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        for row in range(scores.shape[0]):
            real = prompt.real[row].nonzero().flatten()
            chosen[row][:, real] = self.chosen(prompt, scores, row, real)
        return chosen.float()

    def chosen(self, prompt: Prompt, scores: torch.Tensor, row: int, real: torch.Tensor) -> torch.Tensor:
        """[Hkv, m] bool: the tokens sequence ``row`` keeps of its ``real`` columns [m] (exactly C per KV head)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Chunk(Selecting):
    """kvpress's ``ChunkPress`` (after FINCH, Corallo & Papotti 2024): the prompt cut into chunks of
    ``chunk_length`` tokens from its first (the last may be shorter), each compressed alone by the base.

    Each chunk is scored by the base with only that chunk's keys, values and hidden states, as though it were the
    whole prompt (its protected tokens those of a prompt of the chunk's length), and keeps the base's C of the
    chunk's length (``rounding=down``: kvpress's max(1, int(length * (1 - ratio))); an integer budget B: B of each
    chunk, at most the chunk); C is the chunks' sum. The base is any policy that scores keys, values or hidden
    states (not attention votes: kvpress's ChunkPress refuses attention weights, and its SnapKV would rotate a
    chunk's window queries at the prompt's last positions). Ties keep the newest token (kvpress: ``torch.topk``'s
    order). Prefill and context only.

    Args:
        base: the scoring policy (default ``keydiff``).
        chunk_length: the tokens of a chunk (kvpress's 1024).
    """

    chunk_length: int = 1024
    name: ClassVar[str] = "chunk"
    default_base_name: ClassVar[str] = "keydiff"
    example: ClassVar[dict[str, Any]] = {"chunk_length": 8}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "chunk_length", self.chunk_length, integer=True, low=1)

    def pieces(self, length: int) -> list[range]:
        return [range(start, min(start + self.chunk_length, length)) for start in range(0, length, self.chunk_length)]

    def capacity(self, length: int) -> int:
        return sum(min(len(part), self.base.capacity(len(part))) for part in self.pieces(length))

    def chosen(self, prompt: Prompt, scores: torch.Tensor, row: int, real: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros(scores.shape[1], real.numel(), dtype=torch.bool, device=scores.device)
        for part in self.pieces(real.numel()):
            kept = min(len(part), self.base.capacity(len(part)))
            found = piece_scores(self.base, piece(prompt, row, real[part.start : part.stop], kept))[0]
            chosen.scatter_(-1, part.start + best(found, kept), True)
        return chosen


@dataclass(frozen=True)
class Block(Selecting):
    """kvpress's ``BlockPress`` (the block-wise prefill of KeyDiff, Park et al. 2025, arXiv:2504.15364): the prompt
    compressed block by block, each block scored with what each KV head kept of the earlier ones.

    With C the base's for the prompt (``rounding=down``: kvpress's int(length * (1 - ratio))), each KV head starts
    from the prompt's first C tokens; each following block of ``block_size`` tokens joins them, the base scores the
    C + block tokens as a prompt of their own (its protected tokens those of a prompt of that length), and the best
    C stay. Ties keep the newest token (kvpress: ``torch.topk``'s order). The base is any policy that scores keys,
    values or hidden states, as for ``chunk``. Where it differs from kvpress: a base that reads hidden states gets
    each kept token's own (kvpress splits the hidden size into one slice per KV head, each gathered at that head's
    kept tokens), and the joined tokens are in position order (kvpress: the kept ones in score order, then the
    block; a base whose scores depend on the order, such as one protecting first tokens, then differs). Prefill
    and context only.

    Args:
        base: the scoring policy (default ``keydiff``, the paper's).
        block_size: the tokens of a block (kvpress's 128).
    """

    block_size: int = 128
    name: ClassVar[str] = "block"
    default_base_name: ClassVar[str] = "keydiff"
    example: ClassVar[dict[str, Any]] = {"block_size": 4}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "block_size", self.block_size, integer=True, low=1)

    def capacity(self, length: int) -> int:
        return min(length, self.base.capacity(length))

    def chosen(self, prompt: Prompt, scores: torch.Tensor, row: int, real: torch.Tensor) -> torch.Tensor:
        length = real.numel()
        count = self.capacity(length)
        chosen = torch.zeros(scores.shape[1], length, dtype=torch.bool, device=scores.device)
        for head in range(scores.shape[1]):
            kept = torch.arange(count, device=real.device)
            for start in range(count, length, self.block_size):
                block = torch.arange(start, min(start + self.block_size, length), device=real.device)
                joined = torch.cat([kept, block])
                found = piece_scores(self.base, piece(prompt, row, real[joined], count, head))[0, 0]
                kept = joined[best(found, count)].sort().values
            chosen[head, kept] = True
        return chosen
