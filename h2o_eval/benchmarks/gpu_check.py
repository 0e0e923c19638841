"""Correctness on a GPU, end to end: every policy that holds a cache generates with ``kernels=triton`` (the compiled
Triton kernels) what it generates with ``kernels=torch`` (their PyTorch references) on the same device, its decode
steps replayed as CUDA graphs what they generate eagerly, and the full cache what plain ``generate`` does; and the
grid's answering (a shared context, its copies per question, stacked or not) with graphs what it answers eagerly.

    python -m h2o_eval.benchmarks.gpu_check [--models tiny-llama3 tiny-gemma3] [--dtypes float32 bfloat16] [--grid]

For each model, dtype, protocol (prefill, context), decoding rule (evict, grow) and policy (budget 0.5): two
left-padded random prompts of 96 tokens, 12 greedy new tokens under ``kernels=torch`` and ``kernels=triton``
(eager), and under ``kernels=triton`` with CUDA graphs; then one line: whether the tokens are equal, whether every
layer holds the same positions, how far the held slots' scores are apart, for the kernels and for the graphs (and
how many steps were replays). The tests prove the same in Triton's interpreter and with recorded graphs on the
CPU (``tests/test_kernels.py``, ``tests/test_graphs.py``); this is the check a GPU needs, where the kernels are
compiled and the graphs are CUDA's.

``--grid`` (float32 only) answers three documents' questions with :func:`~h2o_eval.generation.answering.answer` for
several cells under both protocols: eagerly, then with graphs, one copy at a time and stacked (``decoding=grow``),
and one line per setting says how many cells answered exactly as eagerly and one at a time, how many steps were
replays and how many captures failed; a last line does the same for the reasoning runner's batches, whose rows
leave as their answers end (:func:`leaving_answers`). Copies of a cache decode through graphs of their own, and the
rows of a stack or a batch leave as their answers end: the paths a single generation does not take. On the CPU its
graphs are the emulation (``graphs=emulate``, ``kernels=torch``).

A float32 difference is a failure (exit status 1). In bfloat16 a rounding may break a tie the other way, so
differences are shown (``DIFF``) but do not fail.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from h2o_eval.errors import ConfigError

PROMPT, CONTEXT, NEW_TOKENS, BUDGET = 96, 80, 12, 0.5
PROTOCOLS, DECODINGS = ("prefill", "context"), ("evict", "grow")
GRID_POLICIES = ("full", "h2o", "tova", "streaming", "snapkv", "knorm", "adakv", "kvzip", "oracle")
GRID_SETTINGS = (("evict", False), ("grow", False), ("grow", True))  # (decoding, stacked)


def held_positions(cache: Any) -> list[torch.Tensor]:
    """Each evicting layer's held positions, sorted per (sequence, KV head) (-1 for a slot not held); a sliding
    layer (the model's own window) has none of its own."""
    return [
        layer.position.masked_fill(~layer.held, -1).sort(-1).values
        for layer in cache.layers
        if layer.is_initialized and layer.held.numel() and layer.position.shape == layer.held.shape
    ]


def score_gap(first: Any, second: Any) -> float:
    """The largest difference of two caches' scores over the slots both hold."""
    gap = 0.0
    for a, b in zip(first.layers, second.layers, strict=True):
        if a.is_initialized and a.held.numel() and a.scores.shape == b.scores.shape and (a.held & b.held).any():
            gap = max(gap, float((a.scores - b.scores)[a.held & b.held].abs().max()))
    return gap


def same(first: Any, second: Any) -> tuple[bool, float]:
    """Whether two caches hold the same positions in every layer, and the largest difference of their scores."""
    held, other = held_positions(first), held_positions(second)
    equal = len(held) == len(other) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(held, other, strict=True)
    )
    return equal, score_gap(first, second)


def compare(
    model: Any, tokenizer: Any, name: str, protocol: str, decoding: str, ids: torch.Tensor, mask: torch.Tensor
) -> dict[str, tuple[torch.Tensor, Any]]:
    """One policy under ``kernels=torch``, ``kernels=triton`` and ``kernels=triton`` replayed as CUDA graphs: each
    run's (tokens, cache)."""
    from h2o_eval.generation import Batch, generate, greedy
    from h2o_eval.policies import example_policy

    settings = greedy(NEW_TOKENS, tokenizer.pad_token_id)
    runs = {}
    for run, kernels, graphs in (("torch", "torch", False), ("triton", "triton", False), ("graphs", "triton", True)):
        batch = Batch(ids, mask, context_width=CONTEXT if protocol == "context" else None)
        with torch.no_grad():
            policy = example_policy(name, BUDGET)
            runs[run] = generate(
                model, policy, batch, tokenizer, protocol=protocol, kernels=kernels, decoding=decoding,
                graphs=graphs, **settings,
            )  # fmt: skip
    return runs


def verdict(runs: dict[str, tuple[torch.Tensor, Any]], plain: torch.Tensor | None, strict: bool) -> tuple[bool, str]:
    """Whether the runs agree (triton with torch, graphs with eager triton, and, given ``plain``, the full cache with
    plain ``generate``), and the line that says how."""
    (tokens, cache), (tokens_triton, cache_triton), (tokens_graphs, cache_graphs) = runs.values()
    held, gap = same(cache, cache_triton)
    held_graphs, gap_graphs = same(cache_triton, cache_graphs)
    kernels_equal, graphs_equal = torch.equal(tokens, tokens_triton), torch.equal(tokens_triton, tokens_graphs)
    replays = cache_graphs.graphs.replays if cache_graphs.graphs is not None else 0
    line = (
        f"kernels: tokens equal {kernels_equal}, held equal {held}, scores off by {gap:.1e}; graphs ({replays} "
        f"replays): tokens equal {graphs_equal}, held equal {held_graphs}, scores off by {gap_graphs:.1e}"
    )
    ok = kernels_equal and held and graphs_equal and held_graphs
    if plain is not None:
        ok &= not strict or torch.equal(tokens_triton, plain)
        line += f"; tokens equal plain generate's {torch.equal(tokens_triton, plain)}"
    return ok, line


def cache_policies(policies: Sequence[str] | None = None) -> list[str]:
    """The policies given, or every registered one, that hold a cache, each built with its example parameters (a
    policy that needs one, such as ``dms``'s threshold, is checked too)."""
    from h2o_eval.policies import POLICIES, example_policy

    return [name for name in policies or POLICIES if example_policy(name, BUDGET).has_cache]


def check(
    models: Sequence[str],
    dtypes: Sequence[str],
    device: str,
    policies: Sequence[str] | None = None,
    protocols: Sequence[str] = PROTOCOLS,
    decodings: Sequence[str] = DECODINGS,
) -> int:
    """Print one line per case; returns the number of float32 failures."""
    from h2o_eval.generation import greedy
    from h2o_eval.models import load_model

    names = cache_policies(policies)
    failures = 0
    for model_name in models:
        for dtype in dtypes:
            model, tokenizer = load_model(model_name, device=device, dtype=dtype)
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(1000, model.config.vocab_size, (2, PROMPT), generator=generator).to(device)
            mask = torch.ones_like(ids)
            mask[0, :5] = 0
            with torch.no_grad():
                model.set_attn_implementation("sdpa")
                settings = greedy(NEW_TOKENS, tokenizer.pad_token_id)
                plain = model.generate(input_ids=ids, attention_mask=mask, **settings)
            strict = dtype == "float32"
            for protocol in protocols:
                for decoding in decodings:
                    for name in names:
                        case = f"{model_name} {dtype} {protocol} {decoding} {name}"
                        try:
                            runs = compare(model, tokenizer, name, protocol, decoding, ids, mask)
                        except Exception as error:  # a case that cannot run is a failure line; the others still run
                            traceback.print_exc()
                            failures += 1
                            print(f"FAIL {case}: {type(error).__name__}: {error}".splitlines()[0], flush=True)
                            continue
                        ok, line = verdict(runs, plain if name == "full" and protocol == "prefill" else None, strict)
                        failures += strict and not ok
                        print(f"{'ok  ' if ok else 'DIFF'} {case}: {line}", flush=True)
    return failures


@contextlib.contextmanager
def counting_replays() -> Iterator[list[int]]:
    """Within it, every decode step replayed by any cache's graphs counts in the list's one item."""
    from h2o_eval.graphs import DecodeGraphs

    count, real = [0], DecodeGraphs.step

    def step(self: DecodeGraphs, *args: Any, **kwargs: Any) -> Any:
        before = self.replays
        output = real(self, *args, **kwargs)
        count[0] += self.replays - before
        return output

    DecodeGraphs.step = step
    try:
        yield count
    finally:
        DecodeGraphs.step = real


def grid_answers(
    model: Any, tokenizer: Any, names: Sequence[str], decoding: str, stack: bool, graphs: bool | str, kernels: str
) -> list[list[list[int]]]:
    """Every cell's (``names`` under both protocols) generated tokens for three documents of two questions each."""
    from h2o_eval.generation.answering import Cell, Document, Settings, answer
    from h2o_eval.policies import example_policy

    generator = torch.Generator().manual_seed(1)

    def ids(count: int) -> list[int]:
        return torch.randint(1000, model.config.vocab_size, (count,), generator=generator).tolist()

    documents = [Document(ids(width), [ids(6), ids(9)]) for width in (70, 90, 110)]
    cells = [Cell(example_policy(name, BUDGET), protocol) for protocol in PROTOCOLS for name in names]
    settings = Settings(NEW_TOKENS, batch_size=2, kernels=kernels, decoding=decoding, graphs=graphs, stack=stack)
    with torch.no_grad():
        answers = answer(model, tokenizer, cells, documents, settings, label="grid")
    return [[fields["tokens"] for _, _, fields in cell.rows] for cell in answers]


LEAVING = (("h2o", "evict"), ("tova", "evict"), ("streaming", "evict"), ("knorm", "interval"))


def leaving_answers(model: Any, tokenizer: Any, graphs: bool | str, kernels: str) -> list[list[dict]]:
    """The reasoning runner's batches: three prompts of different lengths under each policy of :data:`LEAVING` at
    48 tokens (``knorm`` as kvpress's DecodingPress, every 8 forwards), 24 greedy new tokens, each row leaving the
    batch as its answer ends (``run_batch(leaving=True)``); per policy, each row's fields (tokens, kept entries)."""
    from h2o_eval.generation import GenerationLog, greedy, make_batch, run_batch
    from h2o_eval.policies import Interval, make_policy

    generator = torch.Generator().manual_seed(2)
    device = next(model.parameters()).device
    prompts = [torch.randint(1000, model.config.vocab_size, (n,), generator=generator).tolist() for n in (40, 57, 66)]
    batch = make_batch(prompts, [[] for _ in prompts], tokenizer.pad_token_id, device, split=False)
    found = []
    for name, decoding in LEAVING:
        interval = Interval(compression_interval=8, target_size=48) if decoding == "interval" else None
        with torch.no_grad():
            found.append(run_batch(
                model, make_policy(name, budget=48), batch, GenerationLog(24), tokenizer, protocol="prefill",
                kernels=kernels, decoding=decoding, graphs=graphs, interval=interval, leaving=True,
                **greedy(24, tokenizer.pad_token_id),
            ))  # fmt: skip
    return found


def ending_tokens(rows: list[list[dict]]) -> list[int]:
    """Two tokens the first policy's rows generate (free of any end), at which its rows end at different steps."""
    free = [row["tokens"] for row in rows[0]]
    return next(
        [free[0][a], free[1][b]]
        for a in range(2, 20)
        for b in range(a + 2, 22)
        if len({next((i for i, t in enumerate(tokens) if t in (free[0][a], free[1][b])), None) for tokens in free}) > 1
    )


def leaving_check(model: Any, tokenizer: Any, model_name: str, graphs: bool | str, kernels: str, captures: bool) -> int:
    """One line: the reasoning runner's batches, rows leaving at end tokens chosen so that they leave at different
    steps, with graphs against eager (tokens and kept entries per row); 1 when they differ, else 0."""
    eos = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = None
        model.generation_config.eos_token_id = ending_tokens(leaving_answers(model, tokenizer, False, kernels))
        eager = leaving_answers(model, tokenizer, False, kernels)
        with warnings.catch_warnings(record=True) as caught, counting_replays() as replays:
            warnings.simplefilter("always")
            graphed = leaving_answers(model, tokenizer, graphs, kernels)
    finally:
        model.generation_config.eos_token_id = eos
    failed = sum("decode steps run eagerly" in str(warning.message) for warning in caught)
    equal = sum(a == b for a, b in zip(graphed, eager, strict=True))
    lengths = sorted({len(row["tokens"]) for rows in eager for row in rows})
    ok = equal == len(eager) and (replays[0] > 0 or not captures) and not failed
    print(
        f"{'ok  ' if ok else 'DIFF'} leaving {model_name} float32: {equal} of {len(eager)} policies' rows (lengths "
        f"{lengths}) as eagerly; {replays[0]} replays, {failed} failed captures",
        flush=True,
    )
    return int(not ok)


def grid_check(models: Sequence[str], device: str, policies: Sequence[str] | None = None) -> int:
    """Print one line per model and setting of :data:`GRID_SETTINGS` with graphs; returns how many differ."""
    from h2o_eval.attention import layer_windows
    from h2o_eval.models import load_model

    graphs, kernels = (True, "triton") if device == "cuda" else ("emulate", "torch")
    names = list(policies or GRID_POLICIES)
    failures = 0
    for model_name in models:
        model, tokenizer = load_model(model_name, device=device, dtype="float32")
        captures = all(window is None for window in layer_windows(model)[0])  # a sliding layer is not captured
        eager = grid_answers(model, tokenizer, names, "evict", False, False, kernels)
        for decoding, stack in GRID_SETTINGS:
            case = f"grid {model_name} float32 {decoding} {'stacked' if stack else 'one copy at a time'}"
            reference = (
                eager if decoding == "evict" else grid_answers(model, tokenizer, names, "grow", False, False, kernels)
            )
            with warnings.catch_warnings(record=True) as caught, counting_replays() as replays:
                warnings.simplefilter("always")
                answers = grid_answers(model, tokenizer, names, decoding, stack, graphs, kernels)
            failed = sum("decode steps run eagerly" in str(warning.message) for warning in caught)
            equal = sum(a == b for a, b in zip(answers, reference, strict=True))
            ok = equal == len(answers) and (replays[0] > 0 or not captures) and not failed
            failures += not ok
            print(
                f"{'ok  ' if ok else 'DIFF'} {case}: {equal} of {len(answers)} cells answer as eagerly one copy at a "
                f"time; {replays[0]} replays{'' if captures else ' (a layer slides: no step is captured)'}, "
                f"{failed} failed captures",
                flush=True,
            )
        failures += leaving_check(model, tokenizer, model_name, graphs, kernels, captures)
    return failures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m h2o_eval.benchmarks.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--models", nargs="+", default=["tiny-llama3", "tiny-gemma3"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--policies", nargs="+", help="default: every policy that holds a cache")
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument("--decodings", nargs="+", choices=DECODINGS, default=list(DECODINGS))
    parser.add_argument("--grid", action="store_true", help="the grid's answering with graphs against eager, instead")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)  # cpu: tests
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "error: the GPU check needs a CUDA device (off one: pytest tests/test_kernels.py)\n")
    try:
        if args.grid:
            failures = grid_check(args.models, args.device, args.policies)
        else:
            failures = check(args.models, args.dtypes, args.device, args.policies, args.protocols, args.decodings)
    except ConfigError as error:
        parser.exit(2, f"error: {error}\n")
    what = "grid setting(s)" if args.grid else "float32 case(s)"
    print(f"gpu_check: {failures} {what} differ (kernels=torch against triton, or graphs against eager)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
