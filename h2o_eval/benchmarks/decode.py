"""Decode speed and KV-cache size under eviction: SmolLM2, one ~2,000-token prompt, 128 greedy new tokens.

    python -m h2o_eval.benchmarks.decode --data-dir ../shared/data

The prompt is CNN/DailyMail articles from ``<data-dir>/cnn_dailymail/test.jsonl`` cut to ``--prompt-tokens``.
For ``full``, ``h2o`` and ``local`` at ``--budget`` (prefill protocol: the budget is a fraction of the prompt),
the prompt is prefilled into an EvictionCache, then ``--new-tokens`` tokens are decoded one step at a time;
decode tokens/s excludes the prefill. KV bytes are what the cache holds at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from h2o_eval.cache import EvictionCache
from h2o_eval.models import load_model
from h2o_eval.policies import make_policy


def prompt_ids(tokenizer, data_dir: Path, length: int) -> torch.Tensor:
    articles = (json.loads(line)["article"] for line in (data_dir / "cnn_dailymail" / "test.jsonl").open())
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer(next(articles)).input_ids
    return torch.tensor([ids[:length]])


@torch.no_grad()
def decode(model, prompt: torch.Tensor, policy, new_tokens: int) -> tuple[float, int, int, list[int]]:
    """(decode seconds, KV bytes at the end, entries per KV head at the end, generated ids)."""
    cache = EvictionCache(model, policy, protocol="prefill")
    token = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    generated = [int(token)]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        generated.append(int(token))
    seconds = time.perf_counter() - start
    return seconds, cache.kv_bytes(), int(cache.layers[0].held.sum(-1).max()), generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", default=2000, type=int)
    parser.add_argument("--new-tokens", default=128, type=int)
    parser.add_argument("--budget", default=0.2, type=float)
    parser.add_argument("--repeats", default=2, type=int)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, device="cpu")
    prompt = prompt_ids(tokenizer, args.data_dir, args.prompt_tokens)
    print(
        f"{args.model} on CPU, {torch.get_num_threads()} threads: prompt {prompt.shape[1]} tokens, "
        f"{args.new_tokens} new tokens, greedy, prefill protocol"
    )
    rows = {}
    for name in ("full", "h2o", "local"):
        policy = make_policy(name, budget=args.budget)
        runs = [decode(model, prompt, policy, args.new_tokens) for _ in range(args.repeats)]
        seconds = min(r[0] for r in runs)
        rows[name] = ((args.new_tokens - 1) / seconds, runs[0][1], runs[0][2], runs[0][3])
    full_speed, full_bytes, full_entries, full_ids = rows["full"]
    prompt_bytes = full_bytes * prompt.shape[1] / full_entries
    for name, (speed, kv_bytes, entries, ids) in rows.items():
        label = name if name == "full" else f"{name}@{args.budget}"
        same = sum(a == b for a, b in zip(ids, full_ids, strict=True))
        print(
            f"{label:>10}: {speed:6.1f} tok/s ({speed / full_speed:.2f}x full) | KV {kv_bytes / 2**20:7.2f} MiB, "
            f"{entries} entries/head ({kv_bytes / full_bytes:.1%} of full's, {kv_bytes / prompt_bytes:.1%} of the "
            f"prompt's) | {same}/{len(ids)} tokens as full"
        )


if __name__ == "__main__":
    main()
