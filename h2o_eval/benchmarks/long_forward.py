"""Peak memory and wall time of one long forward under eviction, relative to the full cache.

    python -m h2o_eval.benchmarks.long_forward --data-dir ../shared/data [--lengths 2048 4096 8192]

For each length T (in SmolLM2's tokens of XSUM articles, joined), one forward of T tokens is timed in a fresh
process per setting, after a short warm-up forward, so that its peak RSS is its own: ``full``; ``h2o`` at 0.2
in the simulate protocol (the whole sequence under per-step eviction), the prefill protocol (T - 64 context
tokens compressed, then 64 under eviction) and the context protocol (T - 128 compressed, then 128); and
``snapkv`` at 0.2 in the prefill and context protocols. Prints, per setting, the wall time and the forward's
own peak memory (the peak RSS during the forward, reset after the warm-up, minus the RSS before it), both as
ratios to ``full`` at the same length.
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
    ("h2o", "simulate", 0),
    ("h2o", "prefill", 64),
    ("h2o", "context", 128),
    ("snapkv", "prefill", 64),
    ("snapkv", "context", 128),
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


def one(data_dir: Path, length: int, policy_name: str, protocol: str, tail: int, budget: float) -> dict:
    """One forward of ``length`` tokens; run in its own process (see :func:`main`)."""
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
    policy = make_policy(policy_name, budget=budget)
    for warm in (tokens[:, : 2 * tail + 64], tokens):  # first a short forward: lazy imports, JIT code, thread pools
        reset_peak()
        before, seconds = forward(model, policy, protocol, warm, tail)
    return {"seconds": seconds, "forward_mib": status_mib("VmHWM") - before, "peak_mib": status_mib("VmHWM")}


def forward(model, policy, protocol: str, tokens, tail: int) -> tuple[float, float]:
    """(RSS before, seconds) of one forward of ``tokens`` under ``policy``, the last ``tail`` after the context."""
    import torch

    from h2o_eval.backend import patch

    before = status_mib("VmRSS")
    start = time.perf_counter()
    with torch.no_grad(), patch(model, policy, protocol=protocol) as session:
        session.context_lengths = [tokens.shape[1] - tail]
        model(tokens)
    return before, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--one", nargs=3, metavar=("POLICY", "PROTOCOL", "TAIL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        policy, protocol, tail = args.one
        print(json.dumps(one(args.data_dir.resolve(), args.lengths[0], policy, protocol, int(tail), args.budget)))
        return
    print(f"{'T':>6} {'policy':>8} {'protocol':>9} {'seconds':>8} {'x full':>7} {'forward MiB':>12} {'x full':>7}")
    for length in args.lengths:
        full = None
        for policy, protocol, tail in SETTINGS:
            command = [sys.executable, "-m", "h2o_eval.benchmarks.long_forward", "--data-dir", str(args.data_dir)]
            command += ["--lengths", str(length), "--budget", str(args.budget), "--one", policy, protocol, str(tail)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            full = full or result
            print(
                f"{length:>6} {policy:>8} {protocol:>9} {result['seconds']:>8.1f} "
                f"{result['seconds'] / full['seconds']:>6.2f}x {result['forward_mib']:>12.0f} "
                f"{result['forward_mib'] / max(full['forward_mib'], 1):>6.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
