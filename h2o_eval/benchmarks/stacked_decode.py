"""Decoding speed of stacked cells (``stack_cells``): the compressed caches of a group of leaderboard cells answer
one question batch together through :meth:`~h2o_eval.cache.EvictionCache.stack`, as the long-context runner
decodes them.

    python -m h2o_eval.benchmarks.stacked_decode --data-dir ../shared/data [--model smollm2-135m] \\
        [--policies full,snapkv,streaming] [--length 4096] [--rows 2] [--new-tokens 64] [--ids FILE]

The contexts are ``--rows`` windows of ``--length`` XSUM tokens (as ``decode_speed`` takes them), fed once to the
caches of every policy at kvpress's four compression ratios (``full`` at one) under ``protocol=context
decoding=grow``, each compressed by its policy; a ``--question``-token question then follows in every row, and
``--new-tokens`` tokens are generated greedily (``min_new_tokens`` as well) from all the caches stacked. Prints the
decode's CPU seconds (one thread; from the first token's logits to the end of ``generate``), generated tokens per
second over all rows, and a digest of the generated ids; ``--ids FILE`` writes them, or checks them against FILE,
so that two versions of the stacking can be shown to generate the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from h2o_eval.benchmarks.decode_speed import Clock, digest, prompts

RATIOS = (0.25, 0.5, 0.75, 0.875)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default="full,snapkv,streaming")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ids", type=Path, help="JSON of generated ids: written if absent, else checked")
    args = parser.parse_args()

    from h2o_eval.threads import apply

    apply(args.threads)
    from h2o_eval.cache import EvictionCache
    from h2o_eval.generation import decode, feed, greedy
    from h2o_eval.groups import SharedPrompt
    from h2o_eval.models import load_model
    from h2o_eval.policies import make_policy

    model, tokenizer = load_model(args.model, device="cpu")
    ids = prompts(tokenizer, args.data_dir, args.rows, args.length + args.question)
    context = ids[:, : args.length]
    cells = [
        (name, budget)
        for name in args.policies.split(",")
        for budget in ((1.0,) if name == "full" else tuple(1 - ratio for ratio in RATIOS))
    ]
    caches = [
        EvictionCache(model, make_policy(name, budget=budget), protocol="context", decoding="grow")
        for name, budget in cells
    ]
    feed(model, SharedPrompt(caches), context, torch.ones_like(context))
    clock = Clock()
    stacked = EvictionCache.stack(caches)
    repeated = ids.repeat(len(caches), 1)
    started = time.process_time()
    settings = greedy(
        args.new_tokens,
        model.generation_config.eos_token_id,
        min_new_tokens=args.new_tokens,
        logits_processor=LogitsProcessorList([clock]),
    )
    out = decode(model, stacked, repeated, torch.ones_like(repeated), **settings)
    seconds = time.process_time() - clock.first
    generated = out[:, ids.shape[1] :]
    speed = generated.shape[0] * (args.new_tokens - 1) / seconds
    print(
        f"{args.model}, {len(cells)} cells ({args.policies}) x {args.rows} rows, {args.length}-token contexts, "
        f"{args.new_tokens} new tokens, {torch.get_num_threads()} thread(s): question pass "
        f"{clock.first - started:.1f} s, decode {seconds:.1f} s CPU, {speed:.2f} tokens/s, "
        f"ids {digest(generated)}"
    )
    if args.ids:
        if args.ids.exists():
            same = json.loads(args.ids.read_text()) == generated.tolist()
            print(f"ids the same as {args.ids}: {'yes' if same else 'NO'}")
        else:
            args.ids.write_text(json.dumps(generated.tolist()))


if __name__ == "__main__":
    main()
