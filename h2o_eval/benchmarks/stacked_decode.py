"""Decoding speed of stacked cells (``stack_cells``): the compressed caches of a group of leaderboard cells answer
one question batch together through :meth:`~h2o_eval.cache.EvictionCache.stack`, as the long-context runner
decodes them.

    python -m h2o_eval.benchmarks.stacked_decode [--data-dir ../shared/data] [--model smollm2-135m] \\
        [--policies full,snapkv,streaming] [--length 4096] [--rows 2] [--new-tokens 64] [--ids FILE] \\
        [--device cpu] [--graphs off]

The contexts are ``--rows`` windows of ``--length`` XSUM tokens (as ``decode_speed`` takes them; without
``--data-dir``, seeded random ids, as :mod:`~h2o_eval.benchmarks.gpu` takes them for a model of random weights such
as ``shape-llama-3-8b``), fed once to the caches of every policy at kvpress's four compression ratios (``full`` at
one) under ``protocol=context decoding=grow``, each compressed by its policy; a ``--question``-token question then
follows in every row, and ``--new-tokens`` tokens are generated greedily (``min_new_tokens`` as well) from all the
caches stacked. ``--graphs``: the decode steps eager (``off``), replayed as CUDA graphs (``on``, on CUDA), or
replayed under their emulation (``emulate``); several, comma-separated, run one after the other on the same
compressed contexts. Prints per mode the question pass's and the decode's seconds (on the CPU the process's CPU
time, one thread; on CUDA the device's time, CUDA events), the decode step's milliseconds (all rows at once),
generated tokens per second over all rows, and a digest of the generated ids; ``--ids FILE`` writes them, or checks
them against FILE, so that two versions of the stacking can be shown to generate the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from h2o_eval.benchmarks.decode_speed import Clock as ProcessClock
from h2o_eval.benchmarks.decode_speed import digest, prompts

RATIOS = (0.25, 0.5, 0.75, 0.875)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, help="XSUM's folder's parent; without it, random ids")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default="full,snapkv,streaming")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--graphs", default="off", help="off, on, emulate: comma-separated modes, run in turn")
    parser.add_argument("--ids", type=Path, help="JSON of generated ids: written if absent, else checked")
    args = parser.parse_args()
    modes = {"off": False, "on": True, "emulate": "emulate"}
    if unknown := [mode for mode in args.graphs.split(",") if mode not in modes]:
        parser.error(f"--graphs {','.join(unknown)}: use off, on or emulate")

    from h2o_eval.threads import apply

    apply(args.threads)
    from h2o_eval.benchmarks.gpu import Clock, prompt_ids
    from h2o_eval.cache import EvictionCache
    from h2o_eval.generation import feed
    from h2o_eval.groups import SharedPrompt
    from h2o_eval.models import load_model
    from h2o_eval.policies import make_policy

    model, tokenizer = load_model(args.model, device=args.device)
    device = next(model.parameters()).device
    total = args.length + args.question
    if args.data_dir is None:
        ids = prompt_ids(model.config.vocab_size, args.rows, total)
    else:
        ids = prompts(tokenizer, args.data_dir, args.rows, total)
    ids = ids.to(device)
    context = ids[:, : args.length]
    cells = [
        (name, budget)
        for name in args.policies.split(",")
        for budget in ((1.0,) if name == "full" else tuple(1 - ratio for ratio in RATIOS))
    ]
    found = []
    for mode in args.graphs.split(","):
        caches = [
            EvictionCache(
                model, make_policy(name, budget=budget), protocol="context", decoding="grow", graphs=modes[mode]
            )
            for name, budget in cells
        ]
        feed(model, SharedPrompt(caches), context, torch.ones_like(context))
        stacked = EvictionCache.stack(caches)
        generated, question, seconds = _stacked(model, stacked, ids, len(caches), args, Clock(device))
        steps = args.new_tokens - 1
        print(
            f"{args.model} on {device.type}, graphs {mode}, {len(cells)} cells ({args.policies}) x {args.rows} rows, "
            f"{args.length}-token contexts, {args.new_tokens} new tokens, {torch.get_num_threads()} thread(s): "
            f"question pass {question:.2f} s, decode {seconds:.2f} s ({1000 * seconds / steps:.1f} ms a step), "
            f"{generated.shape[0] * steps / seconds:.2f} tokens/s, ids {digest(generated)}"
        )
        found.append(generated)
    if len(found) > 1:
        print(f"the same ids in every mode: {'yes' if all(torch.equal(f, found[0]) for f in found) else 'NO'}")
    generated = found[0]
    if args.ids:
        if args.ids.exists():
            same = json.loads(args.ids.read_text()) == generated.tolist()
            print(f"ids the same as {args.ids}: {'yes' if same else 'NO'}")
        else:
            args.ids.write_text(json.dumps(generated.tolist()))


def _stacked(model, stacked, ids, count: int, args, clock) -> tuple[torch.Tensor, float, float]:
    """The stack's question and greedy answer: the generated ids [rows, new tokens], the question pass's and the
    decode's seconds (CPU time, or the device's time on CUDA)."""
    from h2o_eval.benchmarks.gpu import FirstToken
    from h2o_eval.generation import decode, greedy

    repeated = ids.repeat(count, 1)
    first = FirstToken(clock) if clock.cuda else ProcessClock()
    settings = greedy(
        args.new_tokens,
        model.generation_config.eos_token_id,
        min_new_tokens=args.new_tokens,
        logits_processor=LogitsProcessorList([first]),
    )
    started = clock.mark() if clock.cuda else time.process_time()
    out = decode(model, stacked, repeated, torch.ones_like(repeated), **settings)
    if clock.cuda:
        end = clock.mark()
        question, seconds = clock.seconds(started, first.mark), clock.seconds(first.mark, end)
    else:
        question, seconds = first.first - started, time.process_time() - first.first
    return out[:, ids.shape[1] :].cpu(), question, seconds


if __name__ == "__main__":
    main()
