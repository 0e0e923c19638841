"""Host work of a decode step: the computing aten ops per layer and step, plain transformers against an
EvictionCache under each cache-holding policy and both decoding rules.

    python -m h2o_eval.benchmarks.decode_ops [--model tiny-llama3] [--prompt 96] [--steps 16]

On a GPU each computing op is a kernel launch, and at batch 1 the launches, not the bandwidth, set a decode
step's pace; counting them on the CPU path needs no GPU. A ``TorchDispatchMode`` counts every aten op that
computes (views such as ``view``, ``expand`` or ``transpose`` make no launch and are not counted) during ``--steps``
forwards of one token after a ``--prompt``-token prefill, divided by layers x steps. ``plain`` is the model's own
SDPA attention with a ``DynamicCache``; every other row is an EvictionCache in the prefill protocol at
``--budget`` (``grow``: nothing evicted after the prompt's compression), and its ``added`` column is its count
minus plain's. ``files``: the project's source files whose functions those forwards run (gpt-fast's decode step
runs in 2).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
# Policies whose cache differs only in its scores' source from one already listed run the same decode step; the
# default rows cover every decode step there is (votes added, replaced, per layer, none; sinks; grow).
POLICIES = ("full", "h2o", "tova", "local", "streaming", "knorm", "random", "snapkv", "adakv", "kvzip")


class ComputingOps(TorchDispatchMode):
    """Counts the aten ops that compute (not views) dispatched while active, by name, and notes the project's source
    files whose functions run (``files``, relative to the repository)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.files: set[str] = set()

    def __enter__(self):
        sys.setprofile(self._profile)
        return super().__enter__()

    def __exit__(self, *args):
        sys.setprofile(None)
        return super().__exit__(*args)

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            path = Path(frame.f_code.co_filename)
            inside = path.is_relative_to(REPO) and path.parts[len(REPO.parts)] in ("h2o_eval", "kernels")
            if inside and path.parent.name != "benchmarks":  # the counting itself is no part of the step
                self.files.add(str(path.relative_to(REPO)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@torch.no_grad()
def count(model, tokenizer, policy: str | None, decoding: str, prompt: int, steps: int, budget: float) -> ComputingOps:
    """The ops of ``steps`` one-token forwards after a ``prompt``-token prefill (``policy`` None: plain)."""
    from transformers import DynamicCache

    from h2o_eval.cache import EvictionCache
    from h2o_eval.generation import settle
    from h2o_eval.policies import example_policy

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + steps), generator=generator)
    mask = torch.ones_like(ids)
    if policy is None:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    else:
        cache = EvictionCache(model, example_policy(policy, budget), protocol="prefill", decoding=decoding)
    model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache, use_cache=True)
    if policy is not None:
        settle(model, cache, tokenizer, ids[:, :prompt], mask[:, :prompt], [[]])
    counter = ComputingOps()
    for step in range(prompt, prompt + steps):
        position = torch.tensor([[step]])
        with counter:
            model(ids[:, step : step + 1], attention_mask=mask[:, : step + 1], position_ids=position, cache=cache)
    return counter


def table(model_name: str, prompt: int, steps: int, budget: float, policies: list[str]) -> list[tuple[str, float, int]]:
    """Rows (setting, computing ops per layer and step, project files run), plain first."""
    from h2o_eval.models import load_model

    model, tokenizer = load_model(model_name, device="cpu")
    layers = model.config.num_hidden_layers
    plain = count(model, tokenizer, None, "evict", prompt, steps, budget)
    rows = [("plain", plain.total / layers / steps, len(plain.files))]
    for name in policies:
        for decoding in ("evict", "grow"):
            ops = count(model, tokenizer, name, decoding, prompt, steps, budget)
            rows.append((f"{name} {decoding}", ops.total / layers / steps, len(ops.files)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama3")
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    args = parser.parse_args()
    rows = table(args.model, args.prompt, args.steps, args.budget, args.policies)
    plain = rows[0][1]
    print(f"{args.model}, {args.prompt}-token prompt, {args.steps} decode steps, budget {args.budget}")
    print("| setting | ops per layer and step | added | files |")
    print("|---|---:|---:|---:|")
    for setting, ops, files in rows:
        print(f"| {setting} | {ops:.1f} | {ops - plain:+.1f} | {files} |")


if __name__ == "__main__":
    main()
