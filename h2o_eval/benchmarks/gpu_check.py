"""Correctness on a GPU, end to end: every policy that holds a cache generates with ``kernels=triton`` (the compiled
Triton kernels) what it generates with ``kernels=torch`` (their PyTorch references) on the same device, and the
full cache generates what plain ``generate`` does.

    python -m h2o_eval.benchmarks.gpu_check [--models tiny-llama3 tiny-gemma3] [--dtypes float32 bfloat16]

For each model, dtype, protocol (prefill, context) and policy (budget 0.5): two left-padded random prompts of 96
tokens, 12 greedy new tokens under each kernel setting, then one line: whether the tokens are equal, whether every
layer holds the same positions, and how far the held slots' scores are apart. The tests prove the same in
Triton's interpreter on the CPU (``tests/test_kernels.py``); this is the check a GPU needs, where the kernels are
compiled. A float32 difference is a failure (exit status 1). In bfloat16 a rounding may break a tie the other
way, so differences are shown (``DIFF``) but do not fail.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from h2o_eval.errors import ConfigError

PROMPT, CONTEXT, NEW_TOKENS, BUDGET = 96, 80, 12, 0.5


def held_positions(cache: Any) -> list[torch.Tensor]:
    """Each evicting layer's held positions, sorted per (sequence, KV head) (-1 for a slot not held); a sliding
    layer (the model's own window) has none of its own."""
    return [
        layer.position.masked_fill(~layer.held, -1).sort(-1).values
        for layer in cache.layers
        if layer.is_initialized and layer.held.numel() and layer.position.shape == layer.held.shape
    ]


def score_gap(first: Any, second: Any) -> float:
    """The largest difference of two caches' scores over the slots both hold."""
    gap = 0.0
    for a, b in zip(first.layers, second.layers, strict=True):
        if a.is_initialized and a.held.numel() and a.scores.shape == b.scores.shape and (a.held & b.held).any():
            gap = max(gap, float((a.scores - b.scores)[a.held & b.held].abs().max()))
    return gap


def compare(
    model: Any, tokenizer: Any, name: str, protocol: str, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool, float]:
    """One policy under both kernel settings: (its tokens with torch, with triton, whether every layer holds the
    same positions, the largest score difference)."""
    from h2o_eval.generation import Batch, generate, greedy
    from h2o_eval.policies import make_policy

    settings = greedy(NEW_TOKENS, tokenizer.pad_token_id)
    runs = {}
    for kernels in ("torch", "triton"):
        batch = Batch(ids, mask, context_width=CONTEXT if protocol == "context" else None)
        with torch.no_grad():
            policy = make_policy(name, budget=BUDGET)
            runs[kernels] = generate(model, policy, batch, tokenizer, protocol=protocol, kernels=kernels, **settings)
    (tokens, cache), (tokens_triton, cache_triton) = runs["torch"], runs["triton"]
    held, held_triton = held_positions(cache), held_positions(cache_triton)
    same_held = len(held) == len(held_triton) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(held, held_triton, strict=True)
    )
    return tokens, tokens_triton, same_held, score_gap(cache, cache_triton)


def check(models: Sequence[str], dtypes: Sequence[str], device: str, policies: Sequence[str] | None = None) -> int:
    """Print one line per case; returns the number of float32 failures."""
    from h2o_eval.generation import greedy
    from h2o_eval.models import load_model
    from h2o_eval.policies import POLICIES, make_policy

    names = [name for name in policies or POLICIES if make_policy(name, budget=BUDGET).has_cache]
    failures = 0
    for model_name in models:
        for dtype in dtypes:
            model, tokenizer = load_model(model_name, device=device, dtype=dtype)
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(1000, model.config.vocab_size, (2, PROMPT), generator=generator).to(device)
            mask = torch.ones_like(ids)
            mask[0, :5] = 0
            with torch.no_grad():
                model.set_attn_implementation("sdpa")
                settings = greedy(NEW_TOKENS, tokenizer.pad_token_id)
                plain = model.generate(input_ids=ids, attention_mask=mask, **settings)
            strict = dtype == "float32"
            for protocol in ("prefill", "context"):
                for name in names:
                    case = f"{model_name} {dtype} {protocol} {name}"
                    try:
                        tokens, tokens_triton, same_held, gap = compare(model, tokenizer, name, protocol, ids, mask)
                    except Exception as error:  # a case that cannot run is a failure line; the others still run
                        traceback.print_exc()
                        failures += 1
                        print(f"FAIL {case}: {type(error).__name__}: {error}".splitlines()[0], flush=True)
                        continue
                    same_tokens = torch.equal(tokens, tokens_triton)
                    line = f"{case}: tokens equal {same_tokens}, held equal {same_held}, scores off by {gap:.1e}"
                    ok = same_tokens and same_held
                    if name == "full" and protocol == "prefill":
                        ok &= not strict or torch.equal(tokens_triton, plain)
                        line += f", tokens equal plain generate's {torch.equal(tokens_triton, plain)}"
                    failures += strict and not ok
                    print(f"{'ok  ' if ok else 'DIFF'} {line}", flush=True)
    return failures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m h2o_eval.benchmarks.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--models", nargs="+", default=["tiny-llama3", "tiny-gemma3"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--policies", nargs="+", help="default: every policy that holds a cache")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)  # cpu: tests
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "error: the GPU check needs a CUDA device (off one: pytest tests/test_kernels.py)\n")
    try:
        failures = check(args.models, args.dtypes, args.device, args.policies)
    except ConfigError as error:
        parser.exit(2, f"error: {error}\n")
    print(f"gpu_check: {failures} float32 case(s) differ between kernels=torch and kernels=triton")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
