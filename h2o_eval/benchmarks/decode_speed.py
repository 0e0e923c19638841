"""Decoding speed through an EvictionCache against plain transformers ``generate``, on the same prompts.

    python -m h2o_eval.benchmarks.decode_speed --data-dir ../shared/data [--batches 1 4] [--lengths 1024 4096]

Prompts are XSUM articles from ``<data-dir>/xsum/test.jsonl`` joined into one stream of SmolLM2 tokens; a batch of B
prompts of T tokens takes B consecutive T-token windows of it, so every setting reads the same prompts (no padding).
Each setting generates ``--new-tokens`` tokens greedily (``min_new_tokens`` as well, so no sequence stops early):
``plain`` is the model's own ``generate`` (its DynamicCache, SDPA attention); ``full`` the same through an
:class:`~h2o_eval.cache.EvictionCache` of the full cache; the others an EvictionCache of the policy at ``--budget``
in the prefill protocol, or in the context protocol (``:context``: the last ``--question`` prompt tokens are the
question, fed after the context is compressed, as ``h2o_eval.generation.complete`` does).

Decode time runs from the first token's logits (the prompt pass done) to the end of ``generate``: new tokens - 1
forwards of one token per sequence. Times are the process's CPU time (``time.process_time``; run with one thread,
it is the work done however the shared cores are scheduled); the settings are interleaved (A B C, A B C, ...) and
each cell reports the median over ``--repeats``. Prints one table: decode tokens/s (generated tokens over all
sequences), its ratio to ``plain`` (plain's tokens/s over the setting's: 1.25 means 25 % slower), the prompt pass's
CPU seconds, the KV bytes held at the end, and a digest of the generated ids (with ``--ids FILE`` they are also
written to / checked against FILE, so that a change can be shown not to change a token).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

SETTINGS = (
    "plain",
    "full",
    "h2o",
    "h2o:context",
    "tova",
    "local",
    "streaming",
    "snapkv",
)


class Clock(LogitsProcessor):
    """Notes the CPU time of the first call: ``generate`` calls it once per step, first after the prompt pass."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.first is None:
            self.first = time.process_time()
        return scores


def prompts(tokenizer, data_dir: Path, batch: int, length: int) -> torch.Tensor:
    """[batch, length] token ids: consecutive windows of XSUM articles joined."""
    from h2o_eval.data import read_jsonl

    ids: list[int] = []
    for row in read_jsonl(data_dir / "xsum" / "test.jsonl", ("document",)):
        ids += tokenizer(row["document"] + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= batch * length:
            break
    return torch.tensor(ids[: batch * length]).view(batch, length)


def kv_bytes(cache) -> int:
    """Bytes of keys and values a cache holds (an EvictionCache's held slots, a DynamicCache's every token)."""
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@torch.no_grad()
def run(model, setting: str, ids: torch.Tensor, new_tokens: int, budget: float, question: int):
    """One generation: (prompt-pass CPU seconds, decode CPU seconds, generated ids [B, new_tokens], KV bytes held
    at the end)."""
    from h2o_eval.cache import EvictionCache
    from h2o_eval.generation import feed, greedy
    from h2o_eval.policies import make_policy

    name, _, protocol = setting.partition(":")
    mask = torch.ones_like(ids)
    clock = Clock()
    kwargs = greedy(
        new_tokens,
        model.generation_config.eos_token_id,
        min_new_tokens=new_tokens,
        logits_processor=LogitsProcessorList([clock]),
        return_dict_in_generate=True,
    )
    start = time.process_time()
    if name == "plain":
        model.set_attn_implementation("sdpa")
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        cache = out.cache
    else:
        protocol = protocol or "prefill"
        cache = EvictionCache(model, make_policy(name, budget=budget), protocol=protocol)
        if protocol == "context":
            feed(model, cache, ids[:, :-question], mask[:, :-question])
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **kwargs)
    end = time.process_time()
    return clock.first - start, end - clock.first, out.sequences[:, ids.shape[1] :], kv_bytes(cache)


def digest(ids: torch.Tensor) -> str:
    return hashlib.sha1(json.dumps(ids.tolist()).encode()).hexdigest()[:8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--question", type=int, default=32, help="question tokens of the context protocol")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), metavar="POLICY[:PROTOCOL]")
    parser.add_argument("--ids", type=Path, help="JSON of generated ids: written if absent, else checked")
    args = parser.parse_args()

    from h2o_eval.threads import apply

    apply(args.threads)
    from h2o_eval.models import load_model

    model, tokenizer = load_model(args.model, device="cpu")
    settings = ["plain", *(s for s in args.settings if s != "plain")]
    known = json.loads(args.ids.read_text()) if args.ids and args.ids.exists() else None
    found: dict[str, list[list[int]]] = {}
    print(
        f"{args.model} on CPU, {torch.get_num_threads()} thread(s); {args.new_tokens} new tokens, greedy; budget "
        f"{args.budget}; median of {args.repeats} interleaved runs, CPU time"
    )
    header = ("T", "B", "setting", "tok/s", "x plain", "prompt s", "KV MiB", "ids", "same")
    print("{:>5} {:>2} {:>12} {:>7} {:>7} {:>8} {:>7} {:>8} {:>5}".format(*header), flush=True)
    for length in args.lengths:
        for batch in args.batches:
            ids = prompts(tokenizer, args.data_dir, batch, length)
            for setting in settings:  # warm-up: lazy imports, JIT code
                run(model, setting, ids[:, : 2 * args.question], 2, args.budget, args.question)
            times: dict[str, list[tuple[float, float]]] = {s: [] for s in settings}
            outputs: dict[str, torch.Tensor] = {}
            held: dict[str, int] = {}
            for _ in range(args.repeats):
                for setting in settings:
                    prompt_s, decode_s, out, held[setting] = run(
                        model, setting, ids, args.new_tokens, args.budget, args.question
                    )
                    times[setting].append((prompt_s, decode_s))
                    if setting in outputs and not torch.equal(outputs[setting], out):
                        raise RuntimeError(f"{setting}: two runs generated different tokens")
                    outputs[setting] = out
            plain = None
            for setting in settings:
                decode_s = statistics.median(d for _, d in times[setting])
                speed = batch * (args.new_tokens - 1) / decode_s
                plain = plain or speed
                key = f"{length}/{batch}/{setting}"
                found[key] = outputs[setting].tolist()
                same = "-" if known is None or key not in known else ("yes" if known[key] == found[key] else "NO")
                print(
                    f"{length:>5} {batch:>2} {setting:>12} {speed:>7.2f} {plain / speed:>6.2f}x "
                    f"{statistics.median(p for p, _ in times[setting]):>8.1f} {held[setting] / 2**20:>7.1f} "
                    f"{digest(outputs[setting]):>8} {same:>5}",
                    flush=True,
                )
    if args.ids and known is None:
        args.ids.write_text(json.dumps(found))


if __name__ == "__main__":
    main()
