"""Peak memory and wall time of one long forward under eviction, relative to the full cache.

    python -m h2o_eval.benchmarks.long_forward --data-dir ../shared/data [--lengths 2048 4096 8192]

For each length T (in SmolLM2's tokens of XSUM articles, joined), one forward of T tokens is timed in a fresh process
per setting, after a short warm-up forward, so that its peak RSS is its own: ``full``; the model without h2o_eval
(``none``: transformers' own attention, where ``full`` goes through the backend); ``h2o`` at 0.2 in the simulate
protocol (the whole sequence under per-step eviction), the prefill protocol (T - 64 context tokens compressed, then 64
under eviction) and the context protocol (T - 128 compressed, then 128); and ``snapkv`` at 0.2 in the prefill and
context protocols (``--only h2o:prefill ...`` picks settings). Prints, per setting, the wall time, the CPU time of the
process (on a shared machine the steadier figure: run with one thread, it is the forward's own work however the cores
are shared) and the forward's own peak memory (the peak RSS during the forward, reset after the warm-up, minus the RSS
before it), each also as a ratio to ``full`` at the same length.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = [
    ("full", "simulate", 0),
    ("none", "-", 0),  # the model without h2o_eval: transformers' own attention, no patch
    ("h2o", "simulate", 0),
    ("h2o", "prefill", 64),
    ("h2o", "context", 128),
    ("snapkv", "prefill", 64),
    ("snapkv", "context", 128),
    # The scorers that need more than votes: the context compressed (KVzip: after its repeat passes), the question
    # fed after it, through an EvictionCache as the generation runners use it.
    ("expected_attention", "context", 128),
    ("keydiff", "context", 128),
    ("criticalkv", "context", 128),
    ("kvzip", "context", 128),
]


def status_mib(field: str) -> float:
    """A memory figure of this process from Linux's /proc/self/status (``VmRSS``: now; ``VmHWM``: the peak since
    :func:`reset_peak`), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM afresh (Linux: writing 5 to clear_refs), so the peak is the forward's, not the model load's."""
    Path("/proc/self/clear_refs").write_text("5")


def one(data_dir: Path, length: int, policy_name: str, protocol: str, tail: int, budget: float, threads: int) -> dict:
    """One forward of ``length`` tokens with ``threads`` threads (torch, numba, BLAS); run in its own process (see
    :func:`main`)."""
    from h2o_eval.threads import apply

    apply(threads)
    import torch

    from h2o_eval.data import read_jsonl
    from h2o_eval.models import load_model
    from h2o_eval.policies import make_policy

    model, tokenizer = load_model("smollm2-135m", device="cpu")
    articles = read_jsonl(data_dir / "xsum" / "test.jsonl", ("document",))
    ids: list[int] = []
    for row in articles:
        ids += tokenizer(row["document"] + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= length:
            break
    tokens = torch.tensor([ids[:length]])
    policy = None if policy_name == "none" else make_policy(policy_name, budget=budget)
    for warm in (tokens[:, : 2 * tail + 64], tokens):  # first a short forward: lazy imports, JIT code, thread pools
        reset_peak()
        before, seconds, cpu = forward(model, tokenizer, policy, protocol, warm, tail)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "forward_mib": status_mib("VmHWM") - before,
        "peak_mib": status_mib("VmHWM"),
    }


def forward(model, tokenizer, policy, protocol: str, tokens, tail: int) -> tuple[float, float, float]:
    """(RSS before, wall seconds, CPU seconds) of one forward of ``tokens`` under ``policy``, the last ``tail``
    after the context: one forward under ``patch``, or, for the scorers that score the context at its compression
    or by extra passes, the context through an EvictionCache (compressed, after its passes), then the tail."""
    import torch

    from h2o_eval import generation
    from h2o_eval.backend import patch
    from h2o_eval.cache import EvictionCache

    before = status_mib("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        if policy is None:
            model(tokens)
        elif policy.rescores or policy.rehearses:
            cache = EvictionCache(model, policy, protocol=protocol)
            context, mask = tokens[:, :-tail], torch.ones_like(tokens[:, :-tail])
            generation.feed(model, cache, context, mask)
            generation.settle(model, cache, tokenizer, context, mask, [[]])
            model(tokens[:, -tail:], cache=cache, use_cache=True)
        else:
            with patch(model, policy, protocol=protocol) as session:
                session.context_lengths = [tokens.shape[1] - tail]
                model(tokens)
    return before, time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1, help="threads per forward (default 1)")
    parser.add_argument("--only", nargs="+", metavar="POLICY:PROTOCOL", help="only these settings (and full)")
    parser.add_argument("--one", nargs=3, metavar=("POLICY", "PROTOCOL", "TAIL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    known = [f"{policy}:{protocol}" for policy, protocol, _ in SETTINGS if policy != "full"]
    if unknown := sorted(set(args.only or ()) - set(known)):
        parser.error(f"--only: no setting {', '.join(unknown)}; the settings are {', '.join(known)}")
    if args.one:
        policy, protocol, tail = args.one
        found = one(args.data_dir.resolve(), args.lengths[0], policy, protocol, int(tail), args.budget, args.threads)
        print(json.dumps(found))
        return
    header = ("T", "policy", "protocol", "seconds", "x full", "CPU s", "x full", "forward MiB", "x full")
    print("{:>6} {:>8} {:>9} {:>8} {:>7} {:>8} {:>7} {:>12} {:>7}".format(*header))
    for length in args.lengths:
        full = None
        for policy, protocol, tail in SETTINGS:
            if args.only and policy != "full" and f"{policy}:{protocol}" not in args.only:
                continue
            command = [sys.executable, "-m", "h2o_eval.benchmarks.long_forward", "--data-dir", str(args.data_dir)]
            command += ["--lengths", str(length), "--budget", str(args.budget), "--threads", str(args.threads)]
            command += ["--one", policy, protocol, str(tail)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            full = full or result
            print(
                f"{length:>6} {policy:>8} {protocol:>9} {result['seconds']:>8.1f} "
                f"{result['seconds'] / full['seconds']:>6.2f}x {result['cpu_seconds']:>8.1f} "
                f"{result['cpu_seconds'] / full['cpu_seconds']:>6.2f}x {result['forward_mib']:>12.0f} "
                f"{result['forward_mib'] / max(full['forward_mib'], 1):>6.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
