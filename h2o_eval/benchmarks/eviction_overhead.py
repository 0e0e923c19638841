"""Wall time of eviction relative to the full cache, on SmolLM2 with local data.

    python -m h2o_eval.benchmarks.eviction_overhead --data-dir ../shared/data
    python -m h2o_eval.benchmarks.eviction_overhead --data-dir DIR --policy snapkv --protocol prefill --tasks piqa

For each workload (COPA 0-shot, all 100 documents; PIQA 5-shot, first 100) the same lm-eval requests are
scored with ``full`` and with ``--policy`` (``h2o``) at ``--budget`` 0.2 in ``--protocol`` (``simulate``),
alternating, ``--repeats`` times; the best time of each is kept. Prints one line per workload: both times, their
ratio, and the accuracies.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from h2o_eval.models import load_model, registry
from h2o_eval.policies import POLICIES, make_policy
from h2o_eval.runners import lmeval, task_registry

WORKLOADS = [("copa", 0, None), ("piqa", 5, 100)]


def time_policy(
    model, tokenizer, policy, protocol, task, shots, limit, data_dir, batch_size, kernels
) -> tuple[float, float]:
    config = {
        "task": task_registry()[task],
        "data_dir": data_dir,
        "protocol": protocol,
        "kernels": kernels,
        "batch_size": batch_size,
        "num_fewshot": shots,
        "limit": limit,
        "seed": 1234,
    }
    start = time.perf_counter()
    evaluation = lmeval.RUNNER.evaluate(model, tokenizer, policy, config)
    return time.perf_counter() - start, evaluation.fields["metrics"]["acc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(registry()))
    parser.add_argument("--budget", default=0.2, type=float)
    parser.add_argument("--batch-size", default=8, type=int)
    parser.add_argument("--repeats", default=2, type=int)
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch"])
    parser.add_argument("--policy", default="h2o", choices=sorted(POLICIES))
    parser.add_argument("--protocol", default="simulate", choices=["simulate", "prefill"])
    parser.add_argument("--tasks", nargs="+", default=[task for task, _, _ in WORKLOADS])
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, device="cpu")
    print(f"{args.model} on CPU, {torch.get_num_threads()} threads, batch {args.batch_size}, kernels={args.kernels}")
    for task, shots, limit in [w for w in WORKLOADS if w[0] in args.tasks]:
        best = {"full": float("inf"), args.policy: float("inf")}
        accuracy = {}
        for _ in range(args.repeats):
            for name in best:
                policy = make_policy(name, budget=args.budget)
                seconds, accuracy[name] = time_policy(
                    model,
                    tokenizer,
                    policy,
                    args.protocol,
                    task,
                    shots,
                    limit,
                    args.data_dir.resolve(),
                    args.batch_size,
                    args.kernels,
                )
                best[name] = min(best[name], seconds)
        print(
            f"{task} {shots}-shot limit={limit}: full {best['full']:.1f} s (acc {accuracy['full']:.3f}) | "
            f"{args.policy}@{args.budget} {args.protocol} {best[args.policy]:.1f} s (acc {accuracy[args.policy]:.3f}) "
            f"| ratio {best[args.policy] / best['full']:.2f}x"
        )


if __name__ == "__main__":
    main()
