from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h2o_eval.errors import ConfigError
from h2o_eval.policies.base import PromptScorer, check_number
from h2o_eval.policies.inputs import Prompt
from h2o_eval.policies.sequences import each_sequence


def prerope_key(prompt: Prompt, columns: torch.Tensor, row: int) -> torch.Tensor:
    """[Hkv, m, D] the keys of one sequence's ``columns`` before rotary embedding, recomputed from the attention's
    input (kvpress's ``get_prerope_key_states``: ``k_proj``, or Phi-3's fused ``qkv_proj``, then the key norm of
    Qwen3/Gemma 3); for a model without rotary embedding, the keys as they are."""
    if prompt.rotary is None:
        return prompt.key[row][:, columns]
    if prompt.hidden_states is None:
        raise ConfigError("this policy needs the attention's input, which this model's forward does not pass")
    module, hidden = prompt.module, prompt.hidden_states[row, columns].unsqueeze(0)
    kv_heads, dim = prompt.key.shape[1], prompt.key.shape[-1]
    if hasattr(module, "qkv_proj"):
        start = prompt.query.shape[1] * dim
        key = module.qkv_proj(hidden)[..., start : start + kv_heads * dim]
    elif hasattr(module, "k_proj"):
        key = module.k_proj(hidden)
    else:
        raise ConfigError(
            f"{type(module).__name__} has no k_proj: this policy needs the keys before rotary embedding; use a "
            "Llama-style model (Llama, Mistral, Qwen, Phi-3, Gemma 3, OPT)"
        )
    key = key.view(1, columns.numel(), kv_heads, dim).transpose(1, 2)
    key = module.k_norm(key) if hasattr(module, "k_norm") else key
    return key[0].to(prompt.key.dtype)


def gaussian_sketch(seed: int, layer: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The random matrix of ``layer``: the (layer + 1)-th draw of ``torch.randn(shape)`` from a CPU generator seeded
    with ``seed``, which is what kvpress draws in that layer on the CPU after ``torch.manual_seed(seed)`` (its
    presses draw once per layer, layer after layer, from the global generator)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(layer + 1):
        drawn = torch.randn(shape, generator=generator, dtype=dtype, device="cpu")  # the CPU generator's draw
    return drawn


def z_normalize(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` minus their mean over every element, divided by their standard deviation (at least 1e-6)."""
    return (scores - scores.mean()) / scores.std().clamp_min(1e-6)


def cholesky_with_jitter(gram: torch.Tensor, jitter: float = 1e-2, tries: int = 5) -> torch.Tensor:
    """The lower Cholesky factor of ``gram`` + jitter * I, the jitter growing tenfold until it factors (kvpress's
    ``LeverageScorePress.chol_with_jitter``)."""
    identity = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    for _ in range(tries):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * identity, upper=False)
        if bool((info == 0).all()):
            return factor
        jitter = max(1e-8, 1e-2 if jitter == 0.0 else 10.0 * jitter)
    raise RuntimeError(f"the leverage scores' Gram matrix did not factor after {tries} tries")


def leverage_scores(keys: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """[..., m] the approximate leverage scores diag(X (X^T X)^-1 X^T) of keys [..., m, D] centred over their m
    tokens and right-multiplied by ``sketch`` [..., D, k] (X in float32), clamped at 0."""
    centred = keys - keys.mean(dim=-2, keepdim=True)
    sketched = torch.matmul(centred, sketch).to(torch.float32)
    transposed = sketched.transpose(-2, -1)
    gram = transposed @ sketched
    factor = cholesky_with_jitter(0.5 * (gram + gram.transpose(-2, -1)))
    solved = torch.cholesky_solve(transposed, factor, upper=False)
    return (sketched * solved.transpose(-2, -1)).sum(dim=-1).clamp_min(0)


def sketched_leverage(prompt: Prompt, columns: torch.Tensor, row: int, dimension: int, seed: int) -> torch.Tensor:
    """[Hkv, m] the z-normalised leverage scores of one sequence's pre-rotary keys at ``columns``, sketched by
    ``dimension`` Gaussian columns scaled by 1 / sqrt(dimension) (:func:`gaussian_sketch`)."""
    keys = prerope_key(prompt, columns, row).unsqueeze(0)
    shape = (1, keys.shape[1], keys.shape[-1], dimension)
    sketch = gaussian_sketch(seed, prompt.layer, shape, keys.dtype).to(keys.device) * (1 / math.sqrt(dimension))
    return z_normalize(leverage_scores(keys, sketch))[0]


@dataclass(frozen=True)
class Leverage(PromptScorer):
    """Approximate leverage scores (Chari & Van Durme 2025, arXiv:2507.08143; kvpress's ``LeverageScorePress``):
    keep the keys that are outliers of the prompt's key geometry.

    A token's score is the statistical leverage of its key before rotary embedding, centred over the prompt and
    sketched by a Gaussian matrix of ``sketch_dimension`` columns (computed through a Cholesky factorisation, as
    kvpress), z-normalised over the layer's KV heads and tokens. Nothing is protected. Prefill and context protocols
    only.

    As kvpress, except for its randomness: kvpress draws each layer's sketch from the global generator, so a
    prompt's sketch depends on everything drawn before it. Here each sequence's layer l takes the (l + 1)-th draw of
    a CPU generator seeded with ``seed`` (on the CPU, what kvpress draws for the first prompt after
    ``torch.manual_seed(seed)``; kvpress's evaluation seeds 42 once per run, and on CUDA draws from the CUDA
    generator). A padded batch scores each sequence's real tokens, z-normalised alone.

    Args:
        sketch_dimension: columns of the Gaussian sketch.
        seed: seeds the sketch.
    """

    sketch_dimension: int = 48
    seed: int = 42
    name: ClassVar[str] = "leverage"
    example: ClassVar[dict[str, Any]] = {"sketch_dimension": 8}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "sketch_dimension", self.sketch_dimension, integer=True, low=1)
        check_number(self.name, "seed", self.seed, integer=True, low=0)

    def compression_scores(self, prompt: Prompt, scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        return prompt.once(f"leverage {self.sketch_dimension} {self.seed}", lambda: self._leverage(prompt))

    def _leverage(self, prompt: Prompt) -> torch.Tensor:
        return each_sequence(
            prompt, lambda row, real: sketched_leverage(prompt, real, row, self.sketch_dimension, self.seed)
        )
