"""What eviction costs on a GPU against the model's own ``generate``: time to first token, decode tokens/s, peak
memory and KV bytes, at a real model's shapes with random weights (nothing to download).

    python -m h2o_eval.benchmarks.gpu [--model shape-llama-3-8b] [--lengths 16384 32768] [--batch 1 8 | max]
        [--policies h2o tova streaming snapkv] [--budget 0.2] [--new-tokens 64] [--rounds 3] [--graphs on off]
        [--decoding evict] [--out results/gpu/FILE.md]

For each prompt length and batch size the settings run in one process, on one prompt of random token ids (seeded
per row: a shorter or smaller setting reads the first tokens and rows of the same ids): ``plain`` is the model's own
``generate`` (transformers' DynamicCache, SDPA attention as transformers picks it: cuDNN's on an H100 or H200),
``plain-nocudnn`` the same with SDPA kept to its flash, memory-efficient and math kernels, ``full`` the same through
an :class:`~h2o_eval.cache.EvictionCache` of the full cache, and each policy an EvictionCache at ``--budget`` in the
prefill protocol, generated the way every runner generates (:func:`h2o_eval.generation.generate`: the prompt attends
in full, is compressed, and decoding follows ``--decoding``: ``evict`` the policy's own rule, ``grow`` nothing
evicted after the compression, kvpress's). Every EvictionCache setting runs once per ``--graphs`` mode: decode steps
captured as CUDA graphs and replayed (``on``), or eager (``off``). ``--rounds`` interleaves the settings (A B C, A B
C, ...), each warmed up once on its own prompt (two new tokens) before its first round; a row gives the median over
the rounds and the decode rate's range:

- ``TTFT s``: ``generate(max_new_tokens=1)``, the prompt pass (and the compression) to the first token;
- ``decode tok/s``: ``--new-tokens`` greedy tokens (``min_new_tokens`` too, so every setting decodes as many):
  batch x (new tokens - 1) over the time from the first token's logits to the end of ``generate``;
- ``peak GiB``: the CUDA allocator's peak over both generations, above what was allocated before the setting
  (the weights and the prompt), the peak reset before each setting;
- ``KV GiB``: the keys and values the cache holds after the last token;
- ``x plain``: the setting's TTFT and decode time per token over plain ``generate``'s.

``--batch max`` finds each setting's largest batch that fits the card (doubling, then bisecting, on a generation of
two new tokens) and measures it there: the H2O paper's throughput at scale.

Times are CUDA events read after one synchronisation, so they include any wait of the GPU on the host. Prints one
Markdown table under a line naming the device; ``--out`` writes it too, rewritten after every row, so that a run
cut short keeps what it measured. A setting that runs out of GPU memory, or fails, is a row that says so (a failure's
traceback goes to stderr) and the other settings still run. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor

from h2o_eval.benchmarks.decode_speed import kv_bytes
from h2o_eval.checks import budget_value
from h2o_eval.errors import ConfigError

DEFAULT_POLICIES = ("h2o", "tova", "streaming", "snapkv")
DTYPES = ("bfloat16", "float16", "float32", "auto")
FIRST_ID = 1000  # prompt ids are drawn above the tokenizers' special tokens
GIB = 2**30
MAX_BATCH = 4096  # --batch max searches below this
COLUMNS = (
    "prompt", "batch", "setting", "graphs", "TTFT s", "x plain", "decode tok/s", "range", "x plain", "peak GiB",
    "KV GiB",
)  # fmt: skip


@dataclass(frozen=True)
class Setting:
    """What generates: ``plain`` or ``plain-nocudnn`` (the model's own ``generate``), or ``policy`` through an
    EvictionCache, its decode steps captured as CUDA graphs or not (``graphs``; None for plain)."""

    name: str
    policy: Any = None
    graphs: bool | None = None

    @property
    def plain(self) -> bool:
        return self.policy is None


@dataclass
class Row:
    """One setting at one prompt length and batch size, over the rounds. ``peak_bytes``: the CUDA allocator's peak
    above what was allocated before the setting (None off CUDA); ``note``: why there are no numbers."""

    length: int
    batch: int
    setting: str
    graphs: bool | None = None
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    kv_bytes: int | None = None
    note: str = ""

    def add(self, other: Row) -> None:
        """Take one more round's numbers."""
        self.ttft_s += other.ttft_s
        self.decode_tokens_per_s += other.decode_tokens_per_s
        if other.peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes or 0, other.peak_bytes)
        self.kv_bytes = other.kv_bytes
        self.note = self.note or other.note

    @property
    def ttft(self) -> float | None:
        return statistics.median(self.ttft_s) if self.ttft_s else None

    @property
    def decode(self) -> float | None:
        return statistics.median(self.decode_tokens_per_s) if self.decode_tokens_per_s else None


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
    """[batch, length] random token ids, each row seeded alone (drawn on the CPU so that every device reads the same
    ones): a smaller batch or a shorter length reads the first rows and tokens of a larger one."""
    rows = [
        torch.randint(FIRST_ID, vocab_size, (length,), generator=torch.Generator().manual_seed(seed * 1_000_003 + row))
        for row in range(batch)
    ]
    return torch.stack(rows)


class Prompts:
    """The seeded prompt of one length at each batch size asked for (:func:`prompt_ids`, made once each)."""

    def __init__(self, vocab_size: int, length: int, seed: int, device: torch.device) -> None:
        self.vocab_size, self.length, self.seed, self.device = vocab_size, length, seed, device
        self.made: dict[int, torch.Tensor] = {}

    def __call__(self, batch: int) -> torch.Tensor:
        if batch not in self.made:
            self.made[batch] = prompt_ids(self.vocab_size, batch, self.length, self.seed).to(self.device)
        return self.made[batch]


def sdpa_without_cudnn() -> Any:
    """SDPA kept to its flash, memory-efficient and math kernels (transformers' own choice on an H100 or H200 is
    cuDNN's, whose host time per one-token call sets plain decoding's pace)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def generation(
    model: Any,
    tokenizer: Any,
    setting: Setting,
    ids: torch.Tensor,
    new_tokens: int,
    first: FirstToken,
    decoding: str = "evict",
) -> Any:
    """Generate ``new_tokens`` greedy tokens for every row of ``ids`` under ``setting``; returns the cache it ends
    with."""
    from transformers import LogitsProcessorList

    from h2o_eval.generation import Batch, generate, greedy

    kwargs = greedy(
        new_tokens, tokenizer.pad_token_id, min_new_tokens=new_tokens, logits_processor=LogitsProcessorList([first])
    )
    mask = torch.ones_like(ids)
    plain = sdpa_without_cudnn() if setting.name == "plain-nocudnn" else contextlib.nullcontext()
    with torch.no_grad(), plain:
        if setting.plain:
            out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
            sequences, cache = out.sequences, out.cache
        else:
            sequences, cache = generate(
                model, setting.policy, Batch(ids, mask), tokenizer, protocol="prefill", kernels="auto",
                decoding=decoding, graphs=setting.graphs, **kwargs,
            )  # fmt: skip
    if sequences.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"{setting.name}: generated {sequences.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return cache


def settle(device: torch.device) -> None:
    """Free what the last generation left, so that the next setting starts from the weights and the prompt."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure(
    model: Any,
    tokenizer: Any,
    setting: Setting,
    ids: torch.Tensor,
    new_tokens: int,
    device: torch.device,
    decoding: str = "evict",
    warm: bool = True,
) -> Row:
    """One setting on one prompt, one round: warm-up (unless ``warm`` is False), TTFT, decode tokens/s, peak memory
    and KV bytes (:class:`Row`)."""
    batch, length = ids.shape
    clock = Clock(device)
    if setting.plain:
        model.set_attn_implementation("sdpa")  # an EvictionCache routed the attention through h2o_eval's backend
    if warm:
        generation(model, tokenizer, setting, ids, 2, FirstToken(clock), decoding)
    settle(device)
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    first = FirstToken(clock)
    start = clock.mark()
    generation(model, tokenizer, setting, ids, 1, first, decoding)
    ttft = clock.seconds(start, clock.mark())
    first = FirstToken(clock)
    cache = generation(model, tokenizer, setting, ids, new_tokens, first, decoding)
    decode = clock.seconds(first.mark, clock.mark())
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    rate = batch * (new_tokens - 1) / decode
    return Row(length, batch, setting.name, setting.graphs, [ttft], [rate], peak, kv_bytes(cache))


def largest_batch(fits: Callable[[int], bool], limit: int = MAX_BATCH) -> int:
    """The largest batch in [1, ``limit``] that ``fits`` (0 if none): doubling while it fits, then bisecting between
    the last batch that fit and the first that did not. ``fits`` must hold below a batch and not above it."""
    if not fits(1):
        return 0
    low = 1
    while low * 2 <= limit and fits(low * 2):
        low *= 2
    high = min(low * 2, limit + 1)  # the first batch known not to fit (or past the limit)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def fits(
    model: Any, tokenizer: Any, setting: Setting, prompt: Callable[[int], torch.Tensor], device: torch.device
) -> Callable[[int], bool]:
    """Whether ``setting`` generates two tokens at a batch without running out of GPU memory."""

    def probe(batch: int) -> bool:
        settle(device)
        try:
            generation(model, tokenizer, setting, prompt(batch), 2, FirstToken(Clock(device)))
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            settle(device)
        return True

    return probe


def _guarded(run: Callable[[], Row], length: int, batch: int, setting: Setting) -> Row:
    """``run()``, or a row that names why it has no numbers: out of GPU memory, or a failure (its traceback on
    stderr), so that one broken setting costs its row, not the other settings' rows."""
    try:
        return run()
    except torch.cuda.OutOfMemoryError:  # the row says so; the traceback's tensors go with the block
        return Row(length, batch, setting.name, setting.graphs, note="out of GPU memory")
    except Exception as error:
        traceback.print_exc()
        note = f"failed: {type(error).__name__}: {error}".splitlines()[0]
        return Row(length, batch, setting.name, setting.graphs, note=note)


def benchmark(
    model: Any,
    tokenizer: Any,
    *,
    lengths: Sequence[int],
    batches: Sequence[int | str],
    settings: Sequence[Setting],
    new_tokens: int,
    device: torch.device,
    rounds: int = 1,
    decoding: str = "evict",
    seed: int = 0,
) -> Iterator[Row]:
    """Every setting at every length and batch size (``"max"``: each setting's largest batch), on one seeded prompt
    of random ids, interleaved over ``rounds``: a row per setting once its rounds ran."""
    for length in lengths:
        prompt = Prompts(model.config.vocab_size, length, seed, device)
        for asked in batches:
            sizes = {}
            for setting in settings:
                if asked == "max":
                    settle(device)
                    sizes[setting] = largest_batch(fits(model, tokenizer, setting, prompt, device))
                else:
                    sizes[setting] = int(asked)
            rows: dict[Setting, Row] = {}
            for round_ in range(rounds):
                for setting in settings:
                    batch = sizes[setting]
                    settle(device)
                    if batch == 0:
                        row = Row(length, 0, setting.name, setting.graphs, note="out of GPU memory at batch 1")
                    else:
                        ids = prompt(batch)
                        row = _guarded(
                            lambda setting=setting, ids=ids, warm=round_ == 0: measure(
                                model, tokenizer, setting, ids, new_tokens, device, decoding, warm=warm
                            ),
                            length, batch, setting,
                        )  # fmt: skip
                    if setting in rows:
                        rows[setting].add(row)
                    else:
                        rows[setting] = row
            yield from rows.values()


def row_line(row: Row, plain: Row | None) -> str:
    """The Markdown line of a row; ``plain``: the same length and batch's plain ``generate``, for the ratios."""

    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def ratio(value: float | None, base: float | None) -> str:
        return "-" if value is None or not base else f"{value / base:.2f}x"

    graphs = "-" if row.graphs is None else ("on" if row.graphs else "off")
    if row.note:
        return f"| {row.length} | {row.batch} | {row.setting} | {graphs} | {row.note} |" + " |" * (len(COLUMNS) - 5)
    plain_ttft = plain.ttft if plain else None
    plain_step = 1 / plain.decode if plain and plain.decode else None
    rates = row.decode_tokens_per_s
    spread = f"{min(rates):.1f}-{max(rates):.1f}" if len(rates) > 1 else "-"
    cells = (
        str(row.length),
        str(row.batch),
        row.setting,
        graphs,
        number(row.ttft, ".3f"),
        ratio(row.ttft, plain_ttft),
        number(row.decode, ".1f"),
        spread,
        ratio(1 / row.decode, plain_step),
        number(None if row.peak_bytes is None else row.peak_bytes / GIB, ".3f"),
        number(row.kv_bytes / GIB, ".3f"),
    )
    return "| " + " | ".join(cells) + " |"


def table_head() -> list[str]:
    """The table's column names and alignment line."""
    return ["| " + " | ".join(COLUMNS) + " |", "|---:|---:|---|---|" + "---:|" * (len(COLUMNS) - 4)]


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
        f"protocol, budget {args.budget}, decoding={args.decoding}; {args.new_tokens} greedy new tokens "
        f"(min_new_tokens too); median of {args.rounds} interleaved round(s), the decode rate's range beside it. "
        "TTFT = generate(max_new_tokens=1); decode tok/s = batch x (new tokens - 1) / time from the first token; "
        "graphs = decode steps captured as CUDA graphs and replayed; peak = CUDA allocator peak above the weights "
        "and prompt; KV = bytes held after the last token; x plain = time over plain generate's. "
        f"torch {found['torch']}, transformers {found['transformers']}, {code}.",
        "",
    ]


def check(args: argparse.Namespace) -> list[Setting]:
    """Refuse bad options in one line before the model loads; returns the settings in the order they run."""
    from h2o_eval.policies import check_decoding, check_protocol, make_policy

    if min(args.lengths) < 1 or any(b != "max" and (not b.isdigit() or int(b) < 1) for b in args.batch):
        raise ConfigError("--lengths take integers >= 1, --batch integers >= 1 or max")
    if args.new_tokens < 2:
        raise ConfigError(f"--new-tokens {args.new_tokens}: decoding speed needs at least 2 new tokens")
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds}: use at least 1")
    check_decoding("prefill", args.decoding)
    modes = [mode == "on" for mode in dict.fromkeys(args.graphs)]
    policies = {"full": make_policy("full", budget=1.0)}
    for name in dict.fromkeys(args.policies):
        if name in ("plain", "plain-nocudnn", "full"):
            continue  # measured in every case
        policy = make_policy(name, budget=args.budget)
        if not policy.has_cache:
            raise ConfigError(f"--policies {name}: it exists only as a simulation, with no cache to generate from")
        check_protocol(policy, "prefill", "auto")
        policies[name] = policy
    plain = [Setting("plain"), Setting("plain-nocudnn")]
    return plain + [Setting(name, policy, graphs) for name, policy in policies.items() for graphs in modes]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m h2o_eval.benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shape-llama-3-8b", help="registry name (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768], help="prompt tokens")
    parser.add_argument("--batch", nargs="+", default=["1"], help="batch sizes, or max: each setting's largest")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument(
        "--budget", type=budget_value, default=0.2, help="a fraction of the prompt (0.2), or tokens (512)"
    )
    parser.add_argument("--decoding", default="evict", help="after the compression: evict (the policy's) or grow")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; rows give their median")
    parser.add_argument("--graphs", nargs="+", choices=("on", "off"), default=["on", "off"])
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
        settings = check(args)
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
        settings=settings,
        new_tokens=args.new_tokens,
        device=device,
        rounds=args.rounds,
        decoding=args.decoding,
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
