"""What eviction holds in memory against the model's own ``generate``, measured on the CPU: the peak of the bytes
of live tensors created during one generation, as CUDA's ``max_memory_allocated`` counts them on a GPU.

    python -m h2o_eval.benchmarks.memory --lengths 4096 8192 --settings plain full h2o:0.2 snapkv:0.2

The model is a random Llama whose KV cache is a large share of what a prompt pass holds, as at Llama-3-8B's shapes
(by default 32 layers, 8 KV heads of 64 dims, a 512-wide residual stream): per token its cache holds 128 KB in
float32 against 17 KB of MLP activations. Each setting generates ``--new-tokens`` greedy tokens after one random
prompt: ``plain`` through transformers' own cache, ``full`` through a full :class:`~h2o_eval.cache.EvictionCache`,
``POLICY:BUDGET`` through that policy's cache in the prefill protocol. The weights are not counted. On a GPU,
``python -m h2o_eval.benchmarks.gpu`` reads the allocator's own peak.
"""

from __future__ import annotations

import argparse
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """While active, the bytes of the tensor storages created by torch operations and still alive (``now``), and
    their peak (``peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self.alive:
                self.alive.add(key)
                self.now += size
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key: int, size: int) -> None:
        self.now -= size
        self.alive.discard(key)


@dataclass
class Measured:
    setting: str
    length: int
    peak: int
    kv: int


def random_llama(layers: int, hidden: int, heads: int, kv_heads: int, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=32000, max_position_embeddings=131072,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def measure(model: Any, setting: str, prompt: torch.Tensor, new_tokens: int) -> Measured:
    """One generation under ``setting`` (``plain``, ``full`` or ``POLICY:BUDGET``) and its peak of live bytes."""
    from h2o_eval import EvictionCache, make_policy
    from h2o_eval.generation import Batch, complete

    settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    mask = torch.ones_like(prompt)
    live = LiveBytes()
    with torch.no_grad():
        if setting == "plain":
            model.set_attn_implementation("sdpa")
            with live:
                out = model.generate(prompt, attention_mask=mask, return_dict_in_generate=True, **settings)
            cache = out.cache
            kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        else:
            name, _, budget = setting.partition(":")
            cache = EvictionCache(model, make_policy(name, budget=float(budget or 1.0)), protocol="prefill")
            with live:
                complete(model, cache, Batch(prompt, mask), None, **settings)
            kv = sum(int(layer.held.sum()) for layer in cache.layers) * cache.entry_bytes()
    return Measured(setting, prompt.shape[1], live.peak, kv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--settings", nargs="+", default=["plain", "full", "h2o:0.2", "snapkv:0.2", "streaming:0.2"])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = random_llama(args.layers, args.hidden, args.heads, args.kv_heads)
    print("| prompt | setting | peak MiB over the weights | x plain | KV MiB held |")
    print("|---:|---|---:|---:|---:|")
    for length in args.lengths:
        prompt = torch.randint(5, 30000, (1, length), generator=torch.Generator().manual_seed(length))
        plain = None
        for setting in args.settings:
            row = measure(model, setting, prompt, args.new_tokens)
            plain = row.peak if setting == "plain" else plain
            ratio = f"{row.peak / plain:.2f}" if plain else "–"
            print(f"| {length} | {setting} | {row.peak / 2**20:.0f} | {ratio} | {row.kv / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
