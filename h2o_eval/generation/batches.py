"""A batch of prompts as the generation path takes them, and what is read off the sequences it generates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Batch:
    """Left-padded prompts: ``input_ids`` and ``attention_mask`` [B, T]; ``context_width``: under
    ``protocol=context``, the columns of the contexts (fed and compressed first), else None; ``generated``: how
    many of the last columns were already generated from the prompt before it (a shared prompt pass gives every
    cache the same first token)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    context_width: int | None = None
    generated: int = 0

    @property
    def prompt_tokens(self) -> list[int]:
        return self.attention_mask[:, : self.attention_mask.shape[1] - self.generated].sum(-1).tolist()


def make_batch(contexts: list[list[int]], questions: list[list[int]], pad: int, device: Any, *, split: bool) -> Batch:
    """One batch of token-id prompts, left-padded with ``pad``. ``split`` (protocol=context): every context ends in
    one column and the questions, all of one length, follow; otherwise each prompt is context + question."""
    if split:
        if len({len(q) for q in questions}) != 1:
            raise ValueError("a context-protocol batch needs questions of one length: batch them by length")
        width = max(len(c) for c in contexts)
        rows = [[pad] * (width - len(c)) + c + q for c, q in zip(contexts, questions, strict=True)]
        mask = [[0] * (width - len(c)) + [1] * (len(c) + len(q)) for c, q in zip(contexts, questions, strict=True)]
        return Batch(torch.tensor(rows, device=device), torch.tensor(mask, device=device), width)
    prompts = [c + q for c, q in zip(contexts, questions, strict=True)]
    width = max(len(p) for p in prompts)
    rows = [[pad] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return Batch(torch.tensor(rows, device=device), torch.tensor(mask, device=device))


def greedy(max_new_tokens: int, pad_token_id: int | None, **extra: Any) -> dict[str, Any]:
    """``generate``'s settings for ``max_new_tokens`` greedy tokens (and ``extra``): the model's sampling defaults
    (temperature, top-p, top-k) unset, so that transformers does not warn that greedy decoding ignores them."""
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "pad_token_id": pad_token_id,
        **extra,
    }


def new_tokens(sequences: torch.Tensor, prompt_width: int, ends: set[int]) -> list[list[int]]:
    """Each row's generated tokens, up to (not including) the first end token (end of sequence, or the padding
    ``generate`` puts after a finished row): the one way generated tokens are counted."""
    rows = []
    for tokens in sequences[:, prompt_width:].tolist():
        length = next((i for i, token in enumerate(tokens) if token in ends), len(tokens))
        rows.append(tokens[:length])
    return rows


def steps(model: Any, sequences: torch.Tensor, prompt_width: int) -> int:
    """The steps ``generate`` takes to give these rows alone (when they were generated in a larger batch): until
    every row has generated an end of sequence (the model's ``generation_config``), at most all of them."""
    eos = eos_tokens(model)
    rows = sequences[:, prompt_width:].tolist()
    return max(next((i + 1 for i, token in enumerate(row) if token in eos), len(row)) for row in rows)


def eos_tokens(model: Any) -> set[int]:
    """The tokens that end a row's generation: the model's ``generation_config.eos_token_id``, one or a list."""
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, list) else set() if eos is None else {eos}


def end_tokens(tokenizer: Any) -> set[int]:
    return {token for token in (tokenizer.eos_token_id, tokenizer.pad_token_id) if token is not None}


def fitting_rows(asked: int, row_bytes: int, memory: int) -> int:
    """The rows a batch takes: ``asked``, or fewer where that many rows of ``row_bytes`` each would take more than
    half of ``memory`` (at least one)."""
    return max(1, min(asked, memory // 2 // max(row_bytes, 1)))


def available_memory(device: torch.device) -> int:
    """Bytes free for a run's tensors: the GPU's free memory on CUDA, else the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as info:
        fields = dict(line.split(":", 1) for line in info)
    return int(fields["MemAvailable"].split()[0]) * 1024
