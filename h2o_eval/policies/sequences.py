"""Scoring a padded batch one sequence at a time, on its real prompt tokens alone."""

from __future__ import annotations

from collections.abc import Callable

import torch

from h2o_eval.policies.inputs import Prompt


def each_sequence(
    prompt: Prompt, score: Callable[[int, torch.Tensor], torch.Tensor], fill: float = 0.0
) -> torch.Tensor:
    """[B, Hkv, n] float32: for each sequence with real prompt tokens, ``score(row, columns)`` [Hkv, m] of its m real
    columns (``columns`` [m], in order); ``fill`` on padding and on sequences without a prompt."""
    found = torch.full(prompt.key.shape[:-1], fill, dtype=torch.float32, device=prompt.key.device)
    for row in range(found.shape[0]):
        columns = prompt.real[row].nonzero().flatten()
        if columns.numel() > 0:
            found[row][:, columns] = score(row, columns).float()
    return found
