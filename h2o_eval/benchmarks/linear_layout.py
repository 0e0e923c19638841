"""What storing a linear layer's weight column-major (:func:`h2o_eval.models.decode_layout`, every model loaded on
the CPU) does to torch's products at a model's shapes: per projection and number of rows, GFLOP/s on one thread with
the weight row-major (as transformers builds it) and column-major, and whether the two products are equal bit for
bit.

    python -m h2o_eval.benchmarks.linear_layout [--model smollm2-135m] [--rows 1 10 61 4096] [--tries 5]

A decode step multiplies as many rows as the sequences it decodes (a stack's cells that still answer), a prompt's
pass as many as its tokens. The logits' product is timed at 256 rows at most: a pass computes its last token's.
"""

from __future__ import annotations

import argparse

import torch

from h2o_eval.benchmarks.floor import Shapes, product_rate
from h2o_eval.threads import apply as apply_threads

LOGITS_ROWS = 256


def projections(shapes: Shapes) -> dict[str, tuple[int, int]]:
    """(inner, outer) of each kind of product a decoder layer and its logits make."""
    attention, kv = shapes.q_heads * shapes.head_dim, shapes.kv_heads * shapes.head_dim
    return {
        "query": (shapes.hidden, attention),
        "key, value": (shapes.hidden, kv),
        "output": (attention, shapes.hidden),
        "gate, up": (shapes.hidden, shapes.intermediate),
        "down": (shapes.intermediate, shapes.hidden),
        "logits": (shapes.hidden, shapes.vocab),
    }


def equal(rows: int, inner: int, outer: int) -> bool:
    """Whether one product of random tokens by one weight is bit for bit the same with the weight stored either
    way."""
    tokens, weight = torch.randn(rows, inner), torch.randn(outer, inner)
    column_major = weight.t().contiguous().t()
    return torch.equal(torch.nn.functional.linear(tokens, weight), torch.nn.functional.linear(tokens, column_major))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 10, 61, 4096])
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args()
    from h2o_eval.models import load_config

    apply_threads(1)
    shapes = Shapes.of(load_config(args.model))
    print(f"{args.model}, one thread: GFLOP/s of each product, its weight row-major / column-major")
    print("| product | inner x outer | rows | row-major | column-major | ratio | equal |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name, (inner, outer) in projections(shapes).items():
        for rows in sorted({min(rows, LOGITS_ROWS) if name == "logits" else rows for rows in args.rows}):
            plain, laid = (
                product_rate(rows, inner, outer, args.tries, column_major=column_major) / 1e9
                for column_major in (False, True)
            )
            same = "yes" if equal(rows, inner, outer) else "no"
            print(f"| {name} | {inner} x {outer} | {rows} | {plain:.1f} | {laid:.1f} | {laid / plain:.2f} | {same} |")


if __name__ == "__main__":
    main()
