"""The Triton kernels on a GPU: time against their PyTorch references and torch's own attention, bandwidth.

    python -m h2o_eval.benchmarks.kernels                                 # Llama-7B: 32 heads, head dim 128
    python -m h2o_eval.benchmarks.kernels --kv-heads 8 --lengths 8192     # grouped-query (Llama-3-8B)
    python -m h2o_eval.benchmarks.kernels --kv-heads 8 --batch 8 --lengths 32768 --kernels decode

For each length T (2k-16k tokens by default):

- ``prompt``: a T-token prompt's output and votes from ``prompt_votes`` (Triton column pass) for H2O (every row
  votes), SnapKV (its last 32 rows) and TOVA (the last row), against a plain SDPA forward of the same prompt on
  the kernel SDPA picks for it (cuDNN's on an H100/H200), the model's own attention. Target: at most 2x its time
  for H2O, about 1x for the others.
  First, on the first 1024 tokens, how far its output and columns are from ``column_scores_reference`` (which
  checks the log-sum-exp of torch's CUDA kernel, cuDNN's or flash's, and its grouped-query heads, untested off a
  GPU).
- ``decode``: one query per sequence against a cache of C = budget * T held slots, ``decode_attention`` against
  ``decode_attention_reference`` and SDPA over the same slots. Target: at least 50 % of the peak bandwidth at
  batch 8, 32k tokens, Llama-3-8B shapes (the third command). First, how far it is from the reference.
- ``scan``: a T-token chunk from an empty cache, H2O at capacity C, as the simulate protocol runs it, against
  ``attend_chunk_reference`` (skipped where its B x Hq x T x T float32 logits would not fit in free memory).

Bytes (decode, scan) are the least traffic the step needs: every input read once, every output written once.
One line per (kernel, T): the kernel's time, achieved GB/s and share of the device's peak bandwidth, peak
memory, then each baseline's time and the kernel's time as a multiple of it. Needs a CUDA device (refused in
one line without one); the kernels' correctness is checked without one, in Triton's interpreter
(tests/test_kernels.py).
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
CHECKED_TOKENS = 1024  # the prompt pass is checked against its PyTorch definition on this many tokens first


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


def report(
    name: str,
    length: int,
    traffic: int | None,
    kernel: Callable[[], object],
    baselines: dict[str, Callable[[], object] | None],
    peak_gbps: float,
) -> None:
    """One line: the kernel's time, GB/s and share of the peak bandwidth (with ``traffic`` bytes) and peak memory,
    then each baseline's time and the kernel's time as a multiple of it (a baseline None: skipped, it does not fit)."""
    ms, memory = measure(kernel)
    line = f"{name:<18} T={length:<6} triton {ms:9.3f} ms"
    if traffic is not None:
        gbps = traffic / ms / 1e6
        line += f" {gbps:8.1f} GB/s ({100 * gbps / peak_gbps:4.1f} % of {peak_gbps:.0f} GB/s peak)"
    line += f", peak mem {memory / 2**30:6.2f} GiB"
    for label, baseline in baselines.items():
        if baseline is None:
            line += f" | {label}: skipped (does not fit in free memory)"
            continue
        base_ms, base_memory = measure(baseline)
        line += f" | {label} {base_ms:9.3f} ms, peak mem {base_memory / 2**30:6.2f} GiB"
        line += f" (triton {ms / base_ms:5.2f}x its time)"
    print(line)


def prompt_case(args: argparse.Namespace, length: int, peak_gbps: float) -> None:
    """A T-token prompt's output and votes from ``prompt_votes`` (Triton) for H2O (every row votes), SnapKV (its
    last ``window`` rows) and TOVA (the last row), against the model's own attention: a plain SDPA forward of the
    same prompt, on the kernel SDPA picks. The ratio is what the prompt pass costs over the model's attention."""
    from h2o_eval.kernels.prompt import prompt_votes

    query, key, value = random_qkv(args, length, length)
    valid = torch.ones(args.batch, length, dtype=torch.bool, device=DEVICE)
    scaling = args.dim**-0.5

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )

    check = slice(0, min(length, CHECKED_TOKENS))
    for name in ("h2o", "snapkv", "tova"):
        rule = make_policy(name).rule
        short = [t[:, :, check] for t in (query, key, value)] + [valid[:, check], rule.prompt_weights(valid[:, check])]
        output, columns = prompt_votes(*short, scaling, triton=True)
        expected, expected_columns = column_scores_reference(*short, scaling)
        print(
            f"prompt {name}: against column_scores_reference over the first {check.stop} tokens, output off by "
            f"{(output.float() - expected.float()).abs().max():.2e}, columns by "
            f"{(columns - expected_columns).abs().max():.2e} (largest {expected_columns.abs().max():.2e})"
        )
        weights = rule.prompt_weights(valid)
        report(
            f"prompt {name}",
            length,
            None,
            lambda weights=weights: prompt_votes(query, key, value, valid, weights, scaling, triton=True),
            {"sdpa": sdpa},
            peak_gbps,
        )


def decode_case(args: argparse.Namespace, length: int, peak_gbps: float) -> None:
    """One query per sequence against C = budget * T held slots (all held): ``decode_attention`` against
    ``decode_attention_reference`` and against SDPA over the same slots (what a rule that needs no scores runs).
    The bytes are the keys, values, held flags and scores (read and written) the step must move."""
    from h2o_eval.kernels.decode_attention import decode_attention

    slots = make_policy("h2o", budget=args.budget).plan(length).capacity
    query, keys, values = random_qkv(args, 1, slots)
    held = torch.ones(keys.shape[:3], dtype=torch.bool, device=DEVICE)
    scores = torch.zeros(keys.shape[:3], dtype=torch.float32, device=DEVICE)
    scaling = args.dim**-0.5
    traffic = nbytes(query, keys, values, held, scores, scores, query)
    expected_scores, got_scores = scores.clone(), scores.clone()
    expected = decode_attention_reference(query[:, :, 0], keys, values, held, expected_scores, scaling)
    output = decode_attention(query[:, :, 0], keys, values, held, got_scores, scaling)
    print(
        f"decode_attention: against decode_attention_reference, output off by "
        f"{(output.float() - expected.float()).abs().max():.2e}, "
        f"scores by {(got_scores - expected_scores).abs().max():.2e}"
    )
    report(
        "decode_attention",
        length,
        traffic,
        lambda: decode_attention(query[:, :, 0], keys, values, held, scores, scaling),
        {
            "torch": lambda: decode_attention_reference(query[:, :, 0], keys, values, held, scores, scaling),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, scale=scaling, enable_gqa=True
            ),
        },
        peak_gbps,
    )


def scan_case(args: argparse.Namespace, length: int, peak_gbps: float) -> None:
    from h2o_eval.implementation import choose

    attend_chunk_triton = choose("triton", torch.device(DEVICE)).chunk
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
        {"torch": (lambda: attend_chunk_reference(query, key, value, chunk)) if fits else None},
        peak_gbps,
    )


CASES = {"prompt": prompt_case, "decode": decode_case, "scan": scan_case}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="query heads (Llama-7B: 32)")
    parser.add_argument("--kv-heads", type=int, default=32, help="KV heads (Llama-7B: 32; Llama-3-8B: 8)")
    parser.add_argument("--dim", type=int, default=128, help="head dim (Llama-7B: 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--budget", type=float, default=0.2, help="H2O's cache budget, a fraction of T")
    parser.add_argument("--kernels", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(
            2,
            "error: the kernel benchmark needs a CUDA device and torch sees none: run it on a machine with an "
            "NVIDIA GPU and a CUDA build of torch (correctness needs none: pytest tests/test_kernels.py)\n",
        )
    if args.heads % args.kv_heads:
        parser.exit(2, f"error: --heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}\n")
    import triton.testing

    peak_gbps = triton.testing.get_dram_gbps()
    print(
        f"{torch.cuda.get_device_name()}: B={args.batch} Hq={args.heads} Hkv={args.kv_heads} D={args.dim} "
        f"{args.dtype}, H2O budget {args.budget}"
    )
    with torch.no_grad():
        for length in args.lengths:
            for name in args.kernels:
                CASES[name](args, length, peak_gbps)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
