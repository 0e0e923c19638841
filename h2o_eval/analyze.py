"""The H2O paper's section 3 observations on a model: attention sparsity and heavy hitters, per layer.

    python -m h2o_eval.analyze --model smollm2-135m --task copa [--data-dir DIR] [--limit N] [--num-fewshot K]
                               [--out DIR]

Each text is one of the task's real requests as lm-eval builds it (its context, with ``--num-fewshot``
examples drawn by lm-eval's seeded sampler, followed by the gold continuation), tokenized as lm-eval's HFLM
does and run alone (no padding) with eager attention. Per layer:

- sparsity: the share of causal attention entries below 1 % of their row's maximum (pooled over heads, rows and
  sequences); the paper reports > 95 % for most layers of its large models;
- heavy hitters: each token's accumulated attention (column sum over query rows and heads), ranked; the fitted
  power-law exponent alpha (score ~ rank^-alpha) and the share of the total held by the top 5 % / 20 % of tokens.

Writes ``observations.json``, ``sparsity.(png|pdf)`` and ``heavy_hitters.(png|pdf)`` to ``--out`` and prints a
summary table.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from h2o_eval import figures
from h2o_eval.errors import ConfigError, fail
from h2o_eval.models import load_model
from h2o_eval.runners import lmeval, task_registry

THRESHOLD = 0.01
TOP_SHARES = (0.05, 0.2)


def sparsity_counts(attention: torch.Tensor, threshold: float = THRESHOLD) -> tuple[int, int]:
    """``(below, total)`` over the causal entries (key j <= query i) of ``attention`` [heads, T, T]: how many
    are smaller than ``threshold`` times their row's maximum, and how many there are. Counts rather than a
    ratio so that heads, rows and sequences pool by plain addition."""
    heads, length, _ = attention.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=attention.device).tril()
    row_max = attention.masked_fill(~causal, 0).amax(dim=-1, keepdim=True)
    below = (attention < threshold * row_max) & causal
    return int(below.sum()), heads * length * (length + 1) // 2


def accumulated_scores(attention: torch.Tensor) -> torch.Tensor:
    """Each token's accumulated attention [T]: the column sums of the causal part of ``attention`` [heads, T, T]
    over all query rows and heads, the score H2O ranks tokens by."""
    return attention.tril().sum(dim=(0, 1))


def ranked(scores: torch.Tensor) -> torch.Tensor:
    """The scores in decreasing order: index r holds the score of rank r + 1."""
    return scores.sort(descending=True).values


def top_share(scores: torch.Tensor, share: float) -> float:
    """The fraction of the total score held by the ceil(share * T) highest-scoring tokens (at least one)."""
    # The epsilon keeps products such as 0.07 * 100 = 7.000000000000001 from rounding up to one token more.
    count = max(1, math.ceil(share * len(scores) - 1e-9))
    return float(scores.topk(count).values.sum() / scores.sum())


def power_law_exponent(ranked_scores: Sequence[torch.Tensor]) -> float:
    """alpha of score ~ c * rank^-alpha: the least-squares slope of log(score) on log(rank), negated, over the
    points of all sequences (zero scores skipped). Each sequence gets its own intercept, since its total score
    grows with its length; the exponent is then the same whether scores are raw or normalised per sequence.
    NaN when no sequence has two positive scores."""
    covariance = variance = 0.0
    for scores in ranked_scores:
        scores = scores.double()
        keep = scores > 0
        x = torch.arange(1, len(scores) + 1, dtype=torch.float64, device=scores.device)[keep].log()
        y = scores[keep].log()
        if len(x) < 2:
            continue
        x, y = x - x.mean(), y - y.mean()
        covariance += float((x * y).sum())
        variance += float((x * x).sum())
    return -covariance / variance if variance else math.nan


def mean_ranked_share(ranked_scores: Sequence[torch.Tensor]) -> list[float]:
    """The representative heavy-hitter curve: at each rank up to the shortest sequence, the mean over
    sequences of that rank's share of the sequence's total score."""
    shortest = min(len(scores) for scores in ranked_scores)
    shares = torch.stack([scores[:shortest] / scores.sum() for scores in ranked_scores])
    return shares.mean(dim=0).tolist()


@dataclass
class LayerStats:
    """What one layer accumulates over the sequences: small enough to keep for every layer."""

    below: int = 0
    entries: int = 0
    ranked_scores: list[torch.Tensor] = field(default_factory=list)
    top_shares: dict[float, list[float]] = field(default_factory=lambda: {share: [] for share in TOP_SHARES})

    def add(self, attention: torch.Tensor) -> None:
        """Fold in one sequence's attention probabilities [heads, T, T]."""
        below, entries = sparsity_counts(attention)
        self.below += below
        self.entries += entries
        scores = accumulated_scores(attention).cpu()
        self.ranked_scores.append(ranked(scores))
        for share, values in self.top_shares.items():
            values.append(top_share(scores, share))

    def summary(self, layer: int) -> dict[str, Any]:
        """The layer's entry in ``observations.json``: pooled sparsity, exponent, mean top shares and curve."""
        return {
            "layer": layer,
            "sparsity": self.below / self.entries,
            "alpha": power_law_exponent(self.ranked_scores),
            **{share_key(share): sum(values) / len(values) for share, values in self.top_shares.items()},
            "mean_ranked_share": mean_ranked_share(self.ranked_scores),
        }


def share_key(share: float) -> str:
    """The record key of a top share: 0.05 -> ``top5_share``."""
    return f"top{round(100 * share)}_share"


def task_config(name: str) -> dict[str, Any]:
    """The ``conf/task/<name>.yaml`` entry of a log-likelihood task; other names fail listing the valid ones."""
    configs = task_registry()
    valid = ", ".join(sorted(key for key, config in configs.items() if _log_likelihood(config)))
    if name not in configs:
        raise ConfigError(f"unknown task {name!r}: use one of {valid}")
    if not _log_likelihood(configs[name]):
        raise ConfigError(
            f"task {name!r} is a generation task: analyze reads log-likelihood requests, use one of {valid}"
        )
    return configs[name]


def _log_likelihood(task: dict[str, Any]) -> bool:
    """One of the lm-eval tasks this harness names by their lm-eval YAML whose requests are log-likelihoods."""
    return bool(task.get("lm_eval_yaml")) and not lmeval.RUNNER.generates(task)


def request_texts(
    task: dict[str, Any], data_dir: str | Path | None, limit: int | None, num_fewshot: int = 0, seed: int = 1234
) -> list[str]:
    """The first ``limit`` documents' requests with ``num_fewshot`` examples (lm-eval's sampler, seeded as a
    run is), each its context followed by the gold continuation exactly as lm-eval's own task builds them (for
    Winogrande-style tasks the gold one of the contexts). Few-shot contexts make the long texts the
    observations need: a zero-shot request is a few dozen tokens."""
    with tempfile.TemporaryDirectory() as folder:
        manager = lmeval.task_manager(task, data_dir, Path(folder))
        lm_task = manager.load(task["name"])["tasks"][task["name"]]
        lm_task.set_fewshot_seed(seed)
        docs = list(lm_task.eval_docs)[:limit]
    texts = []
    for index, doc in enumerate(docs):
        context = lm_task.fewshot_context(doc, num_fewshot=num_fewshot)
        requests = lm_task.construct_requests(doc, context, metadata=(task["name"], index, 1))
        gold = lm_task.doc_to_text(doc) if lm_task.multiple_input else lm_task.doc_to_target(doc)
        if isinstance(gold, str):
            gold = lm_task.doc_to_choice(doc).index(gold)
        texts.append("".join(requests[gold].arguments))
    return texts


def observe(model: Any, tokenizer: Any, texts: Sequence[str], progress: str = "") -> list[LayerStats]:
    """Per-layer statistics of ``model``'s attention probabilities over ``texts``, one unpadded sequence per
    forward; each layer's attention is reduced to its statistics right after the forward."""
    from tqdm import tqdm

    model.set_attn_implementation("eager")  # the fused kernels never materialise the probabilities
    device = next(model.parameters()).device
    layers: list[LayerStats] = []
    for text in tqdm(texts, desc=progress, unit="seq"):
        ids = torch.tensor([tokenizer.encode(text)], device=device)  # HFLM's encoding: the tokenizer's defaults
        with torch.no_grad():
            attentions = model(ids, output_attentions=True).attentions
        layers = layers or [LayerStats() for _ in attentions]
        for stats, attention in zip(layers, attentions, strict=True):
            stats.add(attention[0].float())
    return layers


def observations(
    model_name: str, task: str, num_fewshot: int, lengths: Sequence[int], layers: Sequence[LayerStats]
) -> dict[str, Any]:
    """The ``observations.json`` record."""
    return {
        "model": model_name,
        "task": task,
        "num_fewshot": num_fewshot,
        "n_sequences": len(lengths),
        "tokens": {
            "mean": sum(lengths) / len(lengths),
            "min": min(lengths),
            "max": max(lengths),
            "total": sum(lengths),
        },
        "threshold": THRESHOLD,
        "top_shares": list(TOP_SHARES),
        "layers": [stats.summary(layer) for layer, stats in enumerate(layers)],
    }


def sparsity_figure(record: dict[str, Any]) -> Any:
    """A bar per layer: percent of causal attention entries below the threshold, with the paper's 95 % line."""
    import matplotlib.pyplot as plt

    layers = record["layers"]
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(layers) + 2), 4))
    ax.bar([row["layer"] for row in layers], [100 * row["sparsity"] for row in layers], color="tab:blue")
    ax.axhline(95, color="black", linestyle="--", linewidth=1, label="95 %")
    ax.set(
        xlabel="layer",
        ylabel=f"entries < {record['threshold']:.0%} of row max (%)",
        ylim=(0, 100),
        title=f"Attention sparsity: {record['model']} on {record['task']} ({record['num_fewshot']}-shot, "
        f"{record['n_sequences']} sequences of {record['tokens']['mean']:.0f} tokens)",
    )
    ax.legend(loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def heavy_hitter_figure(record: dict[str, Any]) -> Any:
    """Left: the mean ranked share of accumulated attention on log-log axes, a line per layer coloured by layer.
    Right: the fitted power-law exponent per layer."""
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    layers = record["layers"]
    colors = ScalarMappable(Normalize(0, max(1, len(layers) - 1)), "viridis")
    fig, (curves, exponents) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for row in layers:
        shares = row["mean_ranked_share"]
        curves.loglog(range(1, len(shares) + 1), shares, color=colors.to_rgba(row["layer"]), marker=".")
    curves.set(
        xlabel="rank",
        ylabel="share of accumulated attention",
        title=f"Ranked accumulated attention (mean over {record['n_sequences']} sequences)",
    )
    curves.grid(which="both", alpha=0.3)
    fig.colorbar(colors, ax=curves, label="layer")
    exponents.plot([row["layer"] for row in layers], [row["alpha"] for row in layers], marker="o")
    exponents.set(xlabel="layer", ylabel="alpha", title="Fitted exponent: score ~ rank^-alpha")
    exponents.grid(alpha=0.3)
    fig.suptitle(f"Heavy hitters: {record['model']} on {record['task']}")
    fig.tight_layout()
    return fig


def table(record: dict[str, Any]) -> str:
    """The per-layer summary as aligned text: layer, sparsity %, alpha and the top shares in %."""
    tops = [share_key(share) for share in record["top_shares"]]
    header = ["layer", "sparsity %", "alpha", *(f"top{round(100 * s)} %" for s in record["top_shares"])]
    lines = ["  ".join(f"{name:>10}" for name in header)]
    for row in record["layers"]:
        cells = [f"{row['layer']:>10}", f"{100 * row['sparsity']:>10.1f}", f"{row['alpha']:>10.3f}"]
        lines.append("  ".join(cells + [f"{100 * row[key]:>10.1f}" for key in tops]))
    return "\n".join(lines)


def write(record: dict[str, Any], out: Path) -> list[Path]:
    """``observations.json`` and both figures (PNG and PDF) under ``out``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "observations.json"]
    written[0].write_text(json.dumps(record, indent=1) + "\n")
    for name, make in (("sparsity", sparsity_figure), ("heavy_hitters", heavy_hitter_figure)):
        written += figures.save(make(record), out / name, dpi=150)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name, Hugging Face id or local path")
    parser.add_argument("--task", default="copa", help="a log-likelihood task of conf/task/")
    parser.add_argument("--data-dir", type=Path, help="read <data-dir>/<task>/<split>.jsonl instead of the hub")
    parser.add_argument("--limit", type=int, help="only the first N documents (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=0, help="in-context examples per text (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("results/observations"), help="output folder")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    try:
        if args.limit is not None and args.limit < 1:
            raise ConfigError(f"--limit {args.limit}: use a document count >= 1")
        if args.num_fewshot < 0:
            raise ConfigError(f"--num-fewshot {args.num_fewshot}: use an integer >= 0")
        texts = request_texts(task_config(args.task), args.data_dir, args.limit, args.num_fewshot)
        model, tokenizer = load_model(args.model)
    except ConfigError as error:
        fail(error)
    layers = observe(model, tokenizer, texts, progress=f"{args.model} {args.task}")
    lengths = [len(scores) for scores in layers[0].ranked_scores]
    record = observations(args.model, args.task, args.num_fewshot, lengths, layers)
    for path in write(record, args.out):
        print(path)
    print(table(record))


if __name__ == "__main__":
    main()
