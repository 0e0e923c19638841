"""What eviction costs on a GPU against the model's own ``generate``: time to first token, decode tokens/s, peak
memory and KV bytes, at a real model's shapes with random weights (nothing to download).

    python -m h2o_eval.benchmarks.gpu [--model shape-llama-3-8b] [--lengths 16384 32768] [--batch 1 8]
        [--policies h2o tova streaming snapkv] [--budget 0.2] [--new-tokens 64] [--out results/gpu/FILE.md]

For each prompt length and batch size, the settings run one after the other in one process, on one prompt of
random token ids (seeded; a shorter or smaller setting reads the first tokens and rows of the same ids): ``plain``
is the model's own ``generate`` (transformers' DynamicCache, SDPA attention), ``full`` the same through an
:class:`~h2o_eval.cache.EvictionCache` of the full cache, and each policy an EvictionCache at ``--budget`` in the
prefill protocol, generated the way every runner generates (:func:`h2o_eval.generation.generate`: the prompt
attends in full, is compressed, and decoding evicts under the policy's rule). Each setting is warmed up once on
its own prompt (two new tokens), then:

- ``TTFT s``: ``generate(max_new_tokens=1)``, the prompt pass (and the compression) to the first token;
- ``decode tok/s``: ``--new-tokens`` greedy tokens (``min_new_tokens`` too, so every setting decodes as many):
  batch x (new tokens - 1) over the time from the first token's logits to the end of ``generate``;
- ``peak GiB``: the CUDA allocator's peak over both generations, above what was allocated before the setting
  (the weights and the prompt), the peak reset before each setting;
- ``KV GiB``: the keys and values the cache holds after the last token;
- ``x plain``: the setting's TTFT and decode time per token over plain ``generate``'s.

Times are CUDA events read after one synchronisation, so they include any wait of the GPU on the host. Prints one
Markdown table under a line naming the device; ``--out`` writes it too, rewritten after every row, so that a run
cut short keeps what it measured. A setting that runs out of GPU memory, or fails, is a row that says so (a failure's
traceback goes to stderr) and the other settings still run. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor

from h2o_eval.benchmarks.decode_speed import kv_bytes
from h2o_eval.errors import ConfigError

DEFAULT_POLICIES = ("h2o", "tova", "streaming", "snapkv")
DTYPES = ("bfloat16", "float16", "float32", "auto")
FIRST_ID = 1000  # prompt ids are drawn above the tokenizers' special tokens
GIB = 2**30
COLUMNS = ("prompt", "batch", "setting", "TTFT s", "x plain", "decode tok/s", "x plain", "peak GiB", "KV GiB")


@dataclass
class Row:
    """One setting at one prompt length and batch size. ``peak_bytes``: the CUDA allocator's peak above what was
    allocated before the setting (None off CUDA); ``note``: why there are no numbers (out of memory)."""

    length: int
    batch: int
    setting: str
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    peak_bytes: int | None = None
    kv_bytes: int | None = None
    note: str = ""


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU (read after one synchronisation), else the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000


class FirstToken(LogitsProcessor):
    """Marks the clock at its first call: ``generate`` calls it once per step, first after the prompt pass."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.mark: Any = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.mark is None:
            self.mark = self.clock.mark()
        return scores


def prompt_ids(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """[batch, length] random token ids (seeded, drawn on the CPU so that every device reads the same ones)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, vocab_size, (batch, length), generator=generator)


def generation(
    model: Any, tokenizer: Any, setting: str, policy: Any, ids: torch.Tensor, new_tokens: int, first: FirstToken
) -> Any:
    """Generate ``new_tokens`` greedy tokens for every row of ``ids`` under ``setting`` (``plain``, or ``policy``
    through an EvictionCache in the prefill protocol); returns the cache it ends with."""
    from transformers import LogitsProcessorList

    from h2o_eval.generation import Batch, generate, greedy

    kwargs = greedy(
        new_tokens, tokenizer.pad_token_id, min_new_tokens=new_tokens, logits_processor=LogitsProcessorList([first])
    )
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if setting == "plain":
            out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
            sequences, cache = out.sequences, out.cache
        else:
            batch = Batch(ids, mask)
            sequences, cache = generate(model, policy, batch, tokenizer, protocol="prefill", kernels="auto", **kwargs)
    if sequences.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"{setting}: generated {sequences.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return cache


def settle(device: torch.device) -> None:
    """Free what the last generation left, so that the next setting starts from the weights and the prompt."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure(
    model: Any, tokenizer: Any, setting: str, policy: Any, ids: torch.Tensor, new_tokens: int, device: torch.device
) -> Row:
    """One setting on one prompt: warm-up, TTFT, decode tokens/s, peak memory and KV bytes (:class:`Row`)."""
    batch, length = ids.shape
    clock = Clock(device)
    if setting == "plain":
        model.set_attn_implementation("sdpa")  # an EvictionCache routed the attention through h2o_eval's backend
    generation(model, tokenizer, setting, policy, ids, 2, FirstToken(clock))
    settle(device)
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    first = FirstToken(clock)
    start = clock.mark()
    generation(model, tokenizer, setting, policy, ids, 1, first)
    ttft = clock.seconds(start, clock.mark())
    first = FirstToken(clock)
    cache = generation(model, tokenizer, setting, policy, ids, new_tokens, first)
    decode = clock.seconds(first.mark, clock.mark())
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    return Row(length, batch, setting, ttft, batch * (new_tokens - 1) / decode, peak, kv_bytes(cache))


def benchmark(
    model: Any,
    tokenizer: Any,
    *,
    lengths: Sequence[int],
    batches: Sequence[int],
    policies: dict[str, Any],
    new_tokens: int,
    device: torch.device,
    seed: int = 0,
) -> Iterator[Row]:
    """Every setting (``plain``, ``full``, then ``policies``: name -> policy) at every length and batch size, on one
    seeded prompt of random ids: the rows, as they are measured."""
    from h2o_eval.policies import make_policy

    settings = {"plain": None, "full": make_policy("full", budget=1.0), **policies}
    prompt = prompt_ids(model.config.vocab_size, max(batches), max(lengths), seed).to(device)
    for length in lengths:
        for batch in batches:
            ids = prompt[:batch, :length].contiguous()
            for setting, policy in settings.items():
                settle(device)
                try:
                    row = measure(model, tokenizer, setting, policy, ids, new_tokens, device)
                except torch.cuda.OutOfMemoryError:  # the row says so; the traceback's tensors go with the block
                    row = Row(length, batch, setting, note="out of GPU memory")
                except Exception as error:  # one broken setting costs its row, not the other settings' rows
                    traceback.print_exc()
                    row = Row(length, batch, setting, note=f"failed: {type(error).__name__}: {error}".splitlines()[0])
                yield row


def row_line(row: Row, plain: Row | None) -> str:
    """The Markdown line of a row; ``plain``: the same length and batch's plain ``generate``, for the ratios."""

    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def ratio(value: float | None, base: float | None) -> str:
        return "-" if value is None or not base else f"{value / base:.2f}x"

    if row.note:
        return f"| {row.length} | {row.batch} | {row.setting} | {row.note} | | | | | |"
    plain_ttft = plain.ttft_s if plain else None
    plain_step = 1 / plain.decode_tokens_per_s if plain and plain.decode_tokens_per_s else None
    cells = (
        str(row.length),
        str(row.batch),
        row.setting,
        number(row.ttft_s, ".3f"),
        ratio(row.ttft_s, plain_ttft),
        number(row.decode_tokens_per_s, ".1f"),
        ratio(1 / row.decode_tokens_per_s, plain_step),
        number(None if row.peak_bytes is None else row.peak_bytes / GIB, ".3f"),
        number(row.kv_bytes / GIB, ".3f"),
    )
    return "| " + " | ".join(cells) + " |"


def table_head() -> list[str]:
    """The table's column names and alignment line."""
    return ["| " + " | ".join(COLUMNS) + " |", "|---:|---:|---|" + "---:|" * (len(COLUMNS) - 3)]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def header(args: argparse.Namespace, model: Any, device: torch.device) -> list[str]:
    """The lines above the table: the device, then what ran and how it was measured."""
    from h2o_eval.results import git_commit, versions

    found, commit = versions(), git_commit()
    code = f"h2o_eval at {(commit['commit'] or 'unknown')[:7]}{' (dirty)' if commit['dirty'] else ''}"
    return [
        f"## {device_name(device)}",
        "",
        f"{args.model} ({model.config.num_hidden_layers} layers, {model.dtype}), random prompt ids; prefill "
        f"protocol, budget {args.budget}; {args.new_tokens} greedy new tokens (min_new_tokens too). TTFT = "
        "generate(max_new_tokens=1); decode tok/s = batch x (new tokens - 1) / time from the first token; peak = "
        "CUDA allocator peak above the weights and prompt; KV = bytes held after the last token; x plain = time "
        f"over plain generate's. torch {found['torch']}, transformers {found['transformers']}, {code}.",
        "",
    ]


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Refuse bad options in one line before the model loads; returns the policies by name."""
    from h2o_eval.policies import check_protocol, make_policy

    if min(args.lengths) < 1 or min(args.batch) < 1:
        raise ConfigError("--lengths and --batch take integers >= 1")
    if args.new_tokens < 2:
        raise ConfigError(f"--new-tokens {args.new_tokens}: decoding speed needs at least 2 new tokens")
    policies = {}
    for name in dict.fromkeys(args.policies):
        if name in ("plain", "full"):
            continue  # measured in every case
        policy = make_policy(name, budget=args.budget)
        if not policy.has_cache:
            raise ConfigError(f"--policies {name}: it exists only as a simulation, with no cache to generate from")
        check_protocol(policy, "prefill", "auto")
        policies[name] = policy
    return policies


def budget(text: str) -> float | int:
    """A budget as the CLI reads one: an integer is a number of tokens, a decimal a fraction (1.0: everything)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: use a fraction in (0, 1] or a number of tokens") from None


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m h2o_eval.benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shape-llama-3-8b", help="registry name (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768], help="prompt tokens")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--budget", type=budget, default=0.2, help="a fraction of the prompt (0.2), or tokens (512)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="of the random prompt ids")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)  # cpu: tests
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: python -m h2o_eval.benchmarks.gpu needs a CUDA device and this machine has none: run it on a GPU "
            "machine (python -m h2o_eval.benchmarks.decode_speed measures decoding on the CPU)",
            file=sys.stderr,
        )
        sys.exit(2)
    from h2o_eval.models import load_config, load_model

    try:
        policies = check(args)
        positions = getattr(load_config(args.model), "max_position_embeddings", None)
        if positions is not None and max(args.lengths) + args.new_tokens > positions:
            raise ConfigError(
                f"--lengths {max(args.lengths)} with --new-tokens {args.new_tokens} pass {args.model}'s {positions} "
                "positions: use shorter prompts"
            )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    model, tokenizer = load_model(args.model, device=str(device), dtype=args.dtype)
    lines = header(args, model, device) + table_head()
    print("\n".join(lines), flush=True)
    plain: dict[tuple[int, int], Row] = {}
    for row in benchmark(
        model,
        tokenizer,
        lengths=args.lengths,
        batches=args.batch,
        policies=policies,
        new_tokens=args.new_tokens,
        device=device,
        seed=args.seed,
    ):
        if row.setting == "plain" and not row.note:
            plain[row.length, row.batch] = row
        lines.append(row_line(row, plain.get((row.length, row.batch))))
        print(lines[-1], flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
