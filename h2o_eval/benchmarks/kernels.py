"""The Triton kernels against their PyTorch references on a GPU: time, achieved GB/s beside the device's peak.

    python -m h2o_eval.benchmarks.kernels                                 # Llama-7B: 32 heads, head dim 128
    python -m h2o_eval.benchmarks.kernels --kv-heads 8 --lengths 8192     # grouped-query (Llama-3-8B)

For each length T (2k-16k tokens by default), each kernel runs against the reference its tests compare it with:

- ``column_scores``: a T-token prompt, attention output plus H2O's column sums (``column_scores_reference``);
- ``decode_attention``: one query per sequence against a cache of C = budget * T held slots
  (``decode_attention_reference``);
- ``eviction_scan``: a T-token chunk from an empty cache, H2O at capacity C, as the simulate protocol runs it
  (``attend_chunk_reference``, skipped where its B x Hq x T x T float32 logits would not fit in free memory).

Bytes are the least traffic the step needs: every input read once, every output written once. One line per
(kernel, T): both times, achieved GB/s, the share of the device's peak bandwidth, the speed-up and peak memory.
Needs a CUDA device; there is none on this project's CI machines, where the kernels run in Triton's interpreter
against the same references (tests/test_kernels.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from h2o_eval.eviction import Chunk, attend_chunk_reference
from h2o_eval.kernels.reference import column_scores_reference, decode_attention_reference
from h2o_eval.policies import make_policy

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DEVICE = torch.device("cuda")


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def random_qkv(args: argparse.Namespace, rows: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random query [B, Hq, rows, D] and key, value [B, Hkv, slots, D] in the benchmark's dtype, on the GPU."""
    dtype = DTYPES[args.dtype]
    query = torch.randn(args.batch, args.heads, rows, args.dim, dtype=dtype, device=DEVICE)
    key = torch.randn(args.batch, args.kv_heads, slots, args.dim, dtype=dtype, device=DEVICE)
    return query, key, torch.randn_like(key)


def measure(fn: Callable[[], object]) -> tuple[float, int]:
    """(milliseconds per call, peak bytes allocated during the calls)."""
    import triton.testing

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ms = triton.testing.do_bench(fn, warmup=5, rep=50)
    return ms, torch.cuda.max_memory_allocated() - before


def report(name: str, length: int, traffic: int, kernel: Callable[[], object], reference: Callable[[], object] | None,
           peak_gbps: float) -> None:  # fmt: skip
    ms, memory = measure(kernel)
    gbps = traffic / ms / 1e6
    line = (
        f"{name:<16} T={length:<6} triton {ms:9.3f} ms {gbps:8.1f} GB/s ({100 * gbps / peak_gbps:4.1f} % of "
        f"{peak_gbps:.0f} GB/s peak), peak mem {memory / 2**30:6.2f} GiB"
    )
    if reference is None:
        print(f"{line} | torch: skipped (its logits do not fit in free memory)")
        return
    ref_ms, ref_memory = measure(reference)
    print(
        f"{line} | torch {ref_ms:9.3f} ms {traffic / ref_ms / 1e6:8.1f} GB/s, peak mem {ref_memory / 2**30:6.2f} GiB"
        f" | {ref_ms / ms:5.1f}x"
    )


def column_scores_case(args: argparse.Namespace, length: int, peak_gbps: float) -> None:
    from h2o_eval.kernels.column_scores import column_scores

    query, key, value = random_qkv(args, length, length)
    valid = torch.ones(args.batch, length, dtype=torch.bool, device=DEVICE)
    weights = valid.float()
    scaling = args.dim**-0.5
    output, columns = column_scores(query, key, value, valid, weights, scaling)
    traffic = nbytes(query, key, value, valid, weights, output, columns)
    report(
        "column_scores",
        length,
        traffic,
        lambda: column_scores(query, key, value, valid, weights, scaling),
        lambda: column_scores_reference(query, key, value, valid, weights, scaling),
        peak_gbps,
    )


def decode_case(args: argparse.Namespace, length: int, peak_gbps: float) -> None:
    from h2o_eval.kernels.decode_attention import decode_attention

    slots = make_policy("h2o", budget=args.budget).plan(length).capacity
    query, keys, values = random_qkv(args, 1, slots)
    query = query[:, :, 0]
    held = torch.ones(keys.shape[:3], dtype=torch.bool, device=DEVICE)
    scores = torch.zeros(keys.shape[:3], dtype=torch.float32, device=DEVICE)
    scaling = args.dim**-0.5
    traffic = nbytes(query, keys, values, held, scores, scores, query)  # scores are read and written
    report(
        "decode_attention",
        length,
        traffic,
        lambda: decode_attention(query, keys, values, held, scores, scaling),
        lambda: decode_attention_reference(query, keys, values, held, scores, scaling),
        peak_gbps,
    )


def scan_case(args: argparse.Namespace, length: int, peak_gbps: float) -> None:
    from h2o_eval.eviction import attend_chunk_triton

    plan = make_policy("h2o", budget=args.budget).plan(length)
    query, key, value = random_qkv(args, length, length)
    per_sequence = torch.ones(args.batch, dtype=torch.int64, device=DEVICE)
    chunk = Chunk(
        held=torch.zeros(args.batch, args.kv_heads, length, dtype=torch.bool, device=DEVICE),
        arriving=torch.ones(args.batch, length, dtype=torch.bool, device=DEVICE),
        position=torch.arange(length, device=DEVICE).expand(args.batch, args.kv_heads, length).contiguous(),
        scores=torch.zeros(args.batch, args.kv_heads, length, dtype=torch.float32, device=DEVICE),
        capacity=(per_sequence * plan.capacity).view(-1, 1).expand(-1, args.kv_heads).contiguous(),
        recent=per_sequence * plan.recent,
        sinks=per_sequence * 0,
        prefill=per_sequence * 0,
        rule=make_policy("h2o").rule,
        scaling=args.dim**-0.5,
    )
    result = attend_chunk_triton(query, key, value, chunk)
    traffic = nbytes(
        query, key, value, chunk.held, chunk.arriving, chunk.position, chunk.scores, result.output, result.held,
        result.scores,
    )  # fmt: skip
    logits_bytes = args.batch * args.heads * length * length * 4
    fits = logits_bytes < 0.5 * torch.cuda.mem_get_info()[0]
    report(
        "eviction_scan",
        length,
        traffic,
        lambda: attend_chunk_triton(query, key, value, chunk),
        (lambda: attend_chunk_reference(query, key, value, chunk)) if fits else None,
        peak_gbps,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="query heads (Llama-7B: 32)")
    parser.add_argument("--kv-heads", type=int, default=32, help="KV heads (Llama-7B: 32; Llama-3-8B: 8)")
    parser.add_argument("--dim", type=int, default=128, help="head dim (Llama-7B: 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--budget", type=float, default=0.2, help="H2O's cache budget, a fraction of T")
    parser.add_argument("--kernels", nargs="+", choices=["column_scores", "decode", "scan"],
                        default=["column_scores", "decode", "scan"])  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(2, "error: the kernel benchmark needs a CUDA device (tests run the kernels in the interpreter)\n")
    if args.heads % args.kv_heads:
        parser.exit(2, f"error: --heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}\n")
    import triton.testing

    peak_gbps = triton.testing.get_dram_gbps()
    print(
        f"{torch.cuda.get_device_name()}: B={args.batch} Hq={args.heads} Hkv={args.kv_heads} D={args.dim} "
        f"{args.dtype}, H2O budget {args.budget}"
    )
    cases = {"column_scores": column_scores_case, "decode": decode_case, "scan": scan_case}
    with torch.no_grad():
        for length in args.lengths:
            for name in args.kernels:
                cases[name](args, length, peak_gbps)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
