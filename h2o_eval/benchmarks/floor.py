"""The least CPU time a one-question board can take on this machine: its fp32 arithmetic and the bytes its decoding
must read, counted, at the rates one thread multiplies matrices and reads memory here.

    python -m h2o_eval.benchmarks.floor RECORDS [--model smollm2-135m] [--documents 40] [--gflops G]

Per task of ``--model``'s records in RECORDS (the cells of a ``protocol=context`` board, one question per context):
the floating-point operations (2 per multiply-add) a document's cells cannot do without, by part, counted from the
model's config and the records' mean lengths, divided by the rate of one fp32 matrix product on one thread at the
prompt pass's largest shape (tokens x hidden by hidden x intermediate, the best of several tries; ``--gflops``
gives it instead), beside what the records measured (their ``generation.cpu_seconds``). Decoding is also bounded by
its reads at the rate one thread sums a large tensor (``--gbps``): every step reads the weights (fp32) once, and
each row the keys and values its cell kept; the cells decode stacked, so a document takes as many steps as its
longest answer, at least the longest of the cells' mean answers. Each part is a lower bound:

- prompt: the context's T tokens once per document through every linear layer, each attending its causal keys (a
  sliding layer's, its last W);
- scoring: KVzip's rehearsal, once per document for its cells (one rehearsal serves every budget): the context's
  tokens again (its chunks skip the chat template's first few, its prompts add a few), each attending every context
  token (a sliding layer: W). Every other scorer's work is left out;
- question: each cell's question tokens through the linear layers, each attending the tokens the cell kept;
- decoding: each cell's answer, every token's logits and every token but the first (which the question's pass
  gives) through the linear layers, each attending the tokens the cell kept; or its reads, if they take longer.

Left out: softmax, norms, rotary embeddings, the attention within a question and its answer, the oracle's and the
other scorers' passes, the model's load. Lengths are the records' means over documents, which undercount the
attention's quadratic work. Doing this arithmetic in fp32 at these rates takes no less.

Decoding is also given in its kernels (:func:`kernel_seconds`): its products at the rate one thread multiplies as
many rows as the task has cells (the layers' and the logits' shapes apart), and its reads of the kept keys and
values at the rate torch's fused attention reads them at a decode step's shape, over keys not in the cache
(:func:`attention_rate`, at the records' mean kept tokens per layer), with nothing else a step does. The last line
gives the board with decoding so and every other part at its floor: what torch's kernels here cannot beat.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PARTS = ("prompt", "scoring", "question", "decoding")


@dataclass(frozen=True)
class Shapes:
    """What a decoder's arithmetic per token depends on, from its (text) config."""

    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    windows: tuple[int | None, ...]  # per layer: a sliding layer's window W, or None for a global layer

    @classmethod
    def of(cls, config: Any) -> Shapes:
        from h2o_eval.attention import windows_of

        windows, bound = windows_of(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
            head_dim, config.vocab_size, tuple(bound if window is None else window for window in windows),
        )  # fmt: skip

    def linear(self) -> int:
        """FLOPs of one token through every layer's projections (queries, keys, values, output) and gated MLP."""
        h, attention = self.hidden, self.q_heads * self.head_dim
        per_layer = h * attention * 2 + 2 * h * self.kv_heads * self.head_dim + 3 * h * self.intermediate
        return 2 * per_layer * len(self.windows)

    def logits(self) -> int:
        """FLOPs of one token's logits over the vocabulary."""
        return 2 * self.hidden * self.vocab

    def weights(self) -> int:
        """Parameters a decode step multiplies by: every layer's projections and MLP, and the logits' matrix."""
        return (self.linear() + self.logits()) // 2

    def entry(self) -> int:
        """Elements of one token's keys and values in one layer."""
        return 2 * self.kv_heads * self.head_dim

    def pair(self) -> int:
        """FLOPs of one query attending one key in one layer: every query head's score and its share of the
        values."""
        return 4 * self.q_heads * self.head_dim

    def causal_pairs(self, tokens: float) -> float:
        """(query, key) pairs of a causal pass over ``tokens`` tokens, summed over layers (a sliding layer's query
        attends its last W tokens, itself included)."""
        return sum(_causal(tokens, window) for window in self.windows)

    def all_pairs(self, queries: float, keys: float) -> float:
        """Pairs of ``queries`` each attending all of ``keys`` tokens (a sliding layer: at most W), over layers."""
        return sum(queries * (keys if window is None else min(keys, window)) for window in self.windows)


def _causal(tokens: float, window: int | None) -> float:
    if window is None or tokens <= window:
        return tokens * (tokens + 1) / 2
    return window * (window + 1) / 2 + (tokens - window) * window


def document_flops(shapes: Shapes, records: list[dict[str, Any]]) -> dict[str, float]:
    """The FLOPs by part (:data:`PARTS`) of one document of a task whose cells are ``records``."""
    context = records[0]["capacity"]["length_mean"]
    flops = dict.fromkeys(PARTS, 0.0)
    flops["prompt"] = context * shapes.linear() + shapes.causal_pairs(context) * shapes.pair()
    if any(record["policy"] == "kvzip" for record in records):
        flops["scoring"] = context * shapes.linear() + shapes.all_pairs(context, context) * shapes.pair()
    for record in records:
        kept = sum(record["capacity"]["layer_capacity_mean"])  # keys a token attends, over layers
        question = record["generation"]["prompt_tokens_mean"] - context
        answer = record["generation"]["generated_tokens_mean"]
        flops["question"] += question * (shapes.linear() + kept * shapes.pair())
        decoded = max(answer - 1, 0)
        flops["decoding"] += answer * shapes.logits() + decoded * (shapes.linear() + kept * shapes.pair())
    return flops


def decoding_bytes(shapes: Shapes, records: list[dict[str, Any]], size: int = 4) -> float:
    """The bytes one document's stacked decoding reads, at least: the weights once a step, for as many steps as
    the longest of the cells' mean answers less its first token, and each cell's kept keys and values once per
    token it decodes (``size`` bytes an element)."""
    steps = max(max(record["generation"]["generated_tokens_mean"] - 1, 0) for record in records)
    rows = sum(
        max(record["generation"]["generated_tokens_mean"] - 1, 0) * sum(record["capacity"]["layer_capacity_mean"])
        for record in records
    )
    return size * (steps * shapes.weights() + rows * shapes.entry())


def kernel_seconds(shapes: Shapes, records: list[dict[str, Any]], mlp: float, logits: float, attention: float) -> float:
    """The CPU seconds one document's stacked decoding would take in torch's kernels alone, at the rates they reach
    here at its shapes: each cell's tokens through the layers' products at ``mlp`` FLOP/s and their logits at
    ``logits`` FLOP/s (products with as many rows as cells stacked), and each decoded token's read of the keys and
    values its cell kept at ``attention`` bytes/s (torch's fused attention over keys not in the cache). What else a
    step does (the cache's appends and layouts, norms, rotary embeddings, the host's dispatch) is left out."""
    seconds = 0.0
    for record in records:
        answer = record["generation"]["generated_tokens_mean"]
        decoded = max(answer - 1, 0)
        kept = sum(record["capacity"]["layer_capacity_mean"])
        seconds += answer * shapes.logits() / logits + decoded * shapes.linear() / mlp
        seconds += 4 * decoded * kept * shapes.entry() / attention
    return seconds


def product_rate(rows: int, inner: int, outer: int, tries: int = 10, column_major: bool = True) -> float:
    """FLOP/s of one fp32 product of ``rows`` tokens [rows, inner] by a weight [outer, inner] on this thread, as a
    linear layer multiplies: the best of ``tries``. The weight is stored column-major, as a model loaded on the CPU
    stores it (:func:`h2o_eval.models.decode_layout`), or row-major, as transformers builds it."""
    tokens = torch.randn(rows, inner)
    weight = torch.randn(inner, outer).t() if column_major else torch.randn(outer, inner)
    return 2 * rows * inner * outer / _fastest(lambda: torch.nn.functional.linear(tokens, weight), tries)


def attention_rate(shapes: Shapes, kept: int, total: int = 2**30) -> float:
    """Bytes/s of keys and values torch's fused attention reads on this thread as a decode step calls it (a KV head's
    query heads as its rows, a mask of held slots) over ``kept`` slots not in the cache: once over distinct layers'
    keys and values filling ``total`` bytes, after a first pass."""
    group, shape = shapes.q_heads // shapes.kv_heads, (1, shapes.kv_heads, kept, shapes.head_dim)
    read = 8 * kept * shapes.kv_heads * shapes.head_dim  # one layer's keys and values, fp32
    layers = max(total // read, 2)
    pairs = [(torch.randn(shape), torch.randn(shape)) for _ in range(layers)]
    query, held = torch.randn(1, shapes.kv_heads, group, shapes.head_dim), torch.ones(1, shapes.kv_heads, 1, kept) > 0

    def attend_all() -> None:
        for key, value in pairs:
            torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=held)

    return layers * read / _fastest(attend_all, 1)


def read_rate(size: int = 2**27, tries: int = 5) -> float:
    """Bytes/s one thread reads here: summing a ``size``-element fp32 tensor, the best of ``tries``."""
    data = torch.ones(size)
    return 4 * size / _fastest(data.sum, tries)


def _fastest(work, tries: int) -> float:
    """The fewest CPU seconds ``work()`` took in ``tries`` runs after a first one."""
    work()
    best = float("inf")
    for _ in range(tries):
        began = time.process_time()
        work()
        best = min(best, time.process_time() - began)
    return best


def measured(records: list[dict[str, Any]]) -> dict[str, float]:
    """The CPU seconds by part per document of a task's cells, as their records split them."""
    return {
        part: sum(record["generation"]["cpu_seconds"][part] / record["n_documents"] for record in records)
        for part in PARTS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--documents", type=int, default=40, help="documents a task, for the board's CPU-hours")
    parser.add_argument("--gflops", type=float, help="the fp32 rate to divide by, instead of measuring it")
    parser.add_argument("--gbps", type=float, help="the read rate in GB/s, instead of measuring it")
    args = parser.parse_args()
    from h2o_eval.models import load_config
    from h2o_eval.results import load_records
    from h2o_eval.threads import apply

    apply(1)
    config = load_config(args.model)
    if config is None:
        raise SystemExit(
            f"error: {args.model}'s config is in its weights: load it once (python -m h2o_eval model={args.model})"
        )
    shapes = Shapes.of(config)
    tasks: dict[str, list[dict]] = {}
    for record in load_records(args.records):
        if record["model"] == args.model and "cpu_seconds" in record.get("generation", {}):
            tasks.setdefault(record["task"], []).append(record)
    if not tasks:
        raise SystemExit(f"error: no record of {args.model} in {args.records} splits its CPU time")
    rate = args.gflops * 1e9 if args.gflops else product_rate(4096, shapes.hidden, shapes.intermediate, tries=5)
    reads = args.gbps * 1e9 if args.gbps else read_rate()
    rows = max(len(records) for records in tasks.values())
    mlp = product_rate(rows, shapes.hidden, shapes.intermediate)
    logits = product_rate(rows, shapes.hidden, shapes.vocab, tries=3)
    kept = [sum(r["capacity"]["layer_capacity_mean"]) / len(shapes.windows) for rs in tasks.values() for r in rs]
    attention = attention_rate(shapes, round(sum(kept) / len(kept)))
    print(f"{args.model}, one thread: fp32 matrix product at {rate / 1e9:.1f} GFLOP/s, reads at {reads / 1e9:.1f} GB/s")
    print(
        f"decoding's kernels at {rows} rows: layers' products {mlp / 1e9:.1f} GFLOP/s, logits {logits / 1e9:.1f}, "
        f"fused attention over keys not in the cache {attention / 1e9:.1f} GB/s"
    )
    print("CPU s per document by part: the floor / what the records measured; decoding in its kernels at their rates")
    print("| task | cells | TFLOP | prompt | scoring | question | decoding | in kernels | total | measured / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    floors, spent, kernels, decoded, bound = 0.0, 0.0, 0.0, 0.0, 0.0
    for task, records in sorted(tasks.items()):
        flops, spent_by_part = document_flops(shapes, records), measured(records)
        seconds = {part: flops[part] / rate for part in PARTS}
        seconds["decoding"] = max(seconds["decoding"], decoding_bytes(shapes, records) / reads)
        floor, took = sum(seconds.values()), sum(spent_by_part.values())
        in_kernels = kernel_seconds(shapes, records, mlp, logits, attention)
        floors, spent = floors + floor, spent + took
        kernels, decoded = kernels + in_kernels, decoded + spent_by_part["decoding"]
        bound += floor - seconds["decoding"] + max(seconds["decoding"], in_kernels)
        parts = " | ".join(f"{seconds[part]:.1f} / {spent_by_part[part]:.1f}" for part in PARTS)
        total = sum(flops.values()) / 1e12
        print(
            f"| {task} | {len(records)} | {total:.2f} | {parts} | {in_kernels:.1f} | {floor:.1f} / {took:.1f} | "
            f"{took / floor:.2f} |"
        )
    hours = args.documents / 3600
    board = f"{len(tasks)} tasks x {args.documents} documents"
    print(f"{board}: floor {floors * hours:.1f} CPU-hours, measured {spent * hours:.1f}")
    print(
        f"decoding in its kernels {kernels * hours:.1f} CPU-hours, measured {decoded * hours:.1f}; the board with "
        f"decoding in its kernels and every other part at its floor: {bound * hours:.1f}"
    )


if __name__ == "__main__":
    main()
