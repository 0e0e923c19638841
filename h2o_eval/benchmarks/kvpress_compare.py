"""The policies that reproduce kvpress presses, against kvpress 0.5.5 itself: the same prompts through both, the
same greedy tokens and logits, and the same KV pairs kept in every layer and KV head.

    pip install --no-deps --target KVPRESS kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 \\
        cachetools==5.5.2 termcolor==3.3.0 "huggingface_hub>=1.3,<2"
    pip wheel --no-deps fire==0.6.0 -w /tmp/fire && pip install --no-deps --target KVPRESS /tmp/fire/fire-*.whl
    python -m h2o_eval.benchmarks.kvpress_compare --kvpress KVPRESS --data-dir ../shared/data \\
        [--presses observed_attention,lagkv,...] [--ratios 0.25 0.75] [--tasks niah_single_2 vt qa_1] \\
        [--length 1024] [--problems 3] [--new-tokens 16] [--model smollm2-135m]

The prompts are RULER documents (``--tasks`` at ``--length`` tokens, generated offline by ``h2o_eval.ruler``),
worded as kvpress's pipeline words them: the context in the chat template's user turn; the question, the end of the
turn and the answer prefix after it (the context, the question and the rest tokenized apart). A reasoning task in
``--tasks`` (``math500``, ``aime24``, ``aime25``, ``gsm8k``, read from ``--data-dir``) gives its first
``--problems`` problems as the ``reasoning`` runner asks them, as kvpress's evaluation does: a context of one space,
the problem as the question (tokenized with the end of the turn), no answer prefix. kvpress runs in a subprocess
whose path holds ``KVPRESS`` and a stub of ``datasets`` (kvpress imports ``load_dataset`` for DuoAttention only);
torch comes from this environment, the model from the folder h2o_eval converted SmolLM2 into. It does what its
pipeline does: the press's forward hooks on a prefill of the context into a ``DynamicCache``, then the question and
greedy steps with ``position_ids`` continuing from the context's length. Query-agnostic presses compress the context
(h2o_eval's ``protocol=context``); kvpress's query-aware ones (``chunkkv``, ``entropy_gated_chunkkv``, ``finch``:
its leaderboard's ``--query_aware``) compress context and question together (``protocol=prefill``). h2o_eval runs
the same token ids through ``EvictionCache`` with ``rounding=down`` (kvpress keeps int(T (1 - ratio)) tokens) and
``decoding=grow`` (its presses act once). kvpress draws its random sketches after ``torch.manual_seed(42)`` before
every press, the policies' default seed.

Per press, prompt and compression ratio it prints T (the compressed tokens), C (the tokens h2o_eval keeps per KV
head, averaged), how many (layer, KV head) pairs keep exactly the tokens kvpress keeps (kvpress's kept keys found
among its full cache's keys; AdaKV's from its masked indices), whether the greedy tokens are equal and the largest
logit difference over the steps both sides reached with the same tokens. Where scores tie exactly, ``torch.topk``
picks among the tied tokens in its own order and h2o_eval keeps the newest: ``lagkv``'s ranks tie across
partitions by design; ``leverage``, ``cur`` and ``non_causal_attention`` give equal scores to repeated tokens in
the first layer (their keys before rotary embedding, or their norms, are equal) and to tokens no query of their
chunk attends to; ``composed``'s SnapKV gives its whole window of 64 one score, more than it keeps of a short
prompt at a high ratio. Their rows are repeated with kvpress's ``topk`` breaking ties towards the newest token
(``ties``: ``newest``). The presses that re-rotate the kept keys (``finch``, kvpress's default;
``key_rerotation_snapkv`` and ``key_rerotation_knorm``, its ``KeyRerotationPress`` over SnapKV with its defaults and
over Knorm) have their kept positions noted where kvpress re-rotates them; kvpress then feeds the question from the
kept count, h2o_eval from the prompt's length, every query at the same distance from every kept key.
``finch_unrotated`` is ``FinchPress(rerotate_keys=False)``. A case kvpress itself fails is printed as such.

kvpress's composition wrappers are query-agnostic: ``chunk`` (ChunkPress over KeyDiff and over Expected Attention,
chunks of 128), ``block`` (BlockPress over KeyDiff, blocks of 128), ``composed`` (ComposedPress of kvpress's SnapKV
then KeyDiff, both at the ratio: int(int(T (1 - ratio)) (1 - ratio)) tokens kept) and ``per_layer``
(PerLayerCompressionPress over KeyDiff at :func:`layer_ratios`). Its layers then hold different lengths, which the
SDPA mask transformers builds for several tokens does not fit (kvpress asks for flash attention): kvpress's side
feeds the question one token at a time.

The decoding presses (``decoding_*``: DecodingPress, ``ratio_decoding_*``: CompressionRatioDecodingPress,
``prefill_decoding_*``: PrefillDecodingPress) compress every :data:`INTERVAL` forwards after the context (the
question counts one, as each greedy token), over their scorer's scores, to int(T (1 - ratio)) tokens, or to
int(seen (1 - ratio)) of the tokens seen so far; kvpress's pipeline runs them in its decoding loop. h2o_eval runs
``decoding="interval"`` (:class:`~h2o_eval.policies.Interval`) after the context kept whole (``full``), or
compressed by the same scorer at the ratio (PrefillDecodingPress). Their greedy tokens go on past the end of the
answer, so that ``--new-tokens`` past 2 x 8 sees two compressions. ``heads equal`` compares the context's
compression, then the cache at the end (kvpress's kept keys found among every key its cache was written; not for
AdaKV), where h2o_eval makes a compression due after the last forward, which kvpress makes within it; C adds what
the end holds of the tokens fed, and of the generated ones. kvpress keeps a compressed cache in ``torch.topk``'s
order (by score), and SnapKV pools its scores along the cache's order: the decoding presses run three ways,
``topk`` (kvpress as it is), ``ordered`` (topk's choice, kept in position order) and ``newest`` (ties towards the
newest token, in position order).
AdaKVPress in DecodingPress (``decoding_adakv``, over Knorm; ``decoding_adakv_keydiff``) does not evict: it masks
what it drops with fake keys written into its cache, which compete again at its next compression, while h2o_eval's
``adakv`` evicts them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from h2o_eval.benchmarks._kvpress_presses import PRESSES, Press, layer_ratios

SEED = 42  # kvpress's evaluation seed, and the default seed of the policies with random sketches
INTERVAL = 8  # the decoding presses' compression_interval (kvpress's default is 512: the cases generate past 8)
DELIMITER = -1  # where kvpress's FINCH delimiter token goes in a prompt (its id exists only on the kvpress side)


@dataclasses.dataclass(frozen=True)
class Case:
    """One press on one prompt at one compression ratio: ``compressed`` is fed with the press (DELIMITER marks
    FINCH's delimiter), ``asked`` after it."""

    press: str
    prompt: str
    ratio: float
    compressed: list[int]
    asked: list[int]
    ties: str = "topk"  # how kvpress breaks ties: torch.topk's order, or towards the newest token; "ordered": topk's
    # ties, its kept tokens in position order (decoding presses)

    @property
    def context(self) -> list[int]:
        """The compressed tokens as the model sees them (without the delimiter)."""
        return [token for token in self.compressed if token != DELIMITER]

    @property
    def window(self) -> int:
        """The tokens after the delimiter (FINCH's window), else 0."""
        return len(self.compressed) - 1 - self.compressed.index(DELIMITER) if DELIMITER in self.compressed else 0


def ruler_prompts(tokenizer: Any, data_dir: Path, tasks: list[str], length: int) -> dict[str, dict[str, list[int]]]:
    """Per RULER task its first document as token ids, worded as kvpress's pipeline words it: ``context`` (the
    chat template up to the end of the context), ``question``, and ``suffix`` (the end of the user turn, the
    assistant header and the answer prefix)."""
    from h2o_eval import ruler

    found = {}
    for name in tasks:
        task = _task(name)
        task["length"] = length
        [document] = ruler.generate(task, count_tokens=ruler.fit_counter(task, tokenizer), data_dir=data_dir, limit=1)
        asked = document["questions"][0]
        separator = "#" * (len(document["context"]) + 10)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": document["context"] + separator}], add_generation_prompt=True, tokenize=False
        )
        context, suffix = rendered.split(separator)
        found[name] = {
            "context": tokenizer.encode(context, add_special_tokens=False),
            "question": tokenizer.encode(asked["question"], add_special_tokens=False),
            "suffix": tokenizer.encode(suffix + asked["answer_prefix"], add_special_tokens=False),
        }
    return found


def reasoning_prompts(tokenizer: Any, data_dir: Path, tasks: list[str], count: int) -> dict[str, dict[str, list[int]]]:
    """Per reasoning task (``math500``, ``aime24``, ``aime25``, ``gsm8k``) its first ``count`` problems as token ids,
    asked as the ``reasoning`` runner asks them (kvpress's evaluation): ``context`` a space in the chat template's user
    turn, ``question`` the problem with the end of the turn and the assistant header (tokenized together), ``suffix``
    none. Named ``task/id`` (the task's id field, else the row's number)."""
    from h2o_eval.data import read_jsonl
    from h2o_eval.runners.long_context import wrap
    from h2o_eval.runners.reasoning import data_file

    found = {}
    for name in tasks:
        task = _task(name)
        rows = read_jsonl(data_file(task, data_dir), (task["problem"], task["answer"]))[:count]
        for number, row in enumerate(rows):
            asked = {"context": " ", "questions": [{"question": row[task["problem"]], "answer_prefix": ""}]}
            prompt = wrap(tokenizer, asked)
            key = str(row[task["id"]]).removeprefix("test/").removesuffix(".json") if task["id"] else number
            found[f"{name}/{key}"] = {"context": prompt.context_ids, "question": prompt.question_ids[0], "suffix": []}
    return found


def prompts(
    tokenizer: Any, data_dir: Path, tasks: list[str], length: int, count: int
) -> dict[str, dict[str, list[int]]]:
    """:func:`ruler_prompts` of the RULER tasks at ``length`` tokens and :func:`reasoning_prompts` of the reasoning
    tasks (``count`` problems each), in the order of ``tasks``."""
    found: dict[str, dict[str, list[int]]] = {}
    for name in tasks:
        if _task(name).get("runner") == "reasoning":
            found |= reasoning_prompts(tokenizer, data_dir, [name], count)
        else:
            found |= ruler_prompts(tokenizer, data_dir, [name], length)
    return found


def _task(name: str) -> dict[str, Any]:
    """A task's config where the package's configs are, installed or editable."""
    return yaml.safe_load((resources.files("h2o_eval.conf") / "task" / f"{name}.yaml").read_text())


def cases(prompts: dict[str, dict[str, list[int]]], presses: list[str], ratios: list[float]) -> list[Case]:
    """Every press on every prompt at every ratio (those whose scores tie again, with ties towards the newest)."""
    found = []
    for name in presses:
        press = PRESSES[name]
        for prompt, parts in prompts.items():
            if not press.query_aware:
                compressed, asked = parts["context"], parts["question"] + parts["suffix"]
            elif press.delimiter:
                compressed, asked = parts["context"] + [DELIMITER] + parts["question"], parts["suffix"]
            else:
                compressed, asked = parts["context"] + parts["question"], parts["suffix"]
            for ratio in ratios:
                modes = ("topk", "ordered", "newest") if press.decoding else ("topk", "newest")
                for ties in modes if press.ties else ("topk",):
                    found.append(Case(name, prompt, ratio, compressed, asked, ties))
    return found


def greedy(step: Callable[[list[int], list[int]], torch.Tensor], case: Case, start: int, new_tokens: int, stop: int):
    """kvpress's ``generate_answer``: the question at positions from ``start``, then greedy tokens one at a time;
    ``step(ids, positions)`` returns the last row's logits. Returns (tokens, logits per token). A decoding press's
    case goes on past ``stop``, so that its compressions come."""
    stop = -1 if PRESSES[case.press].decoding else stop
    logits = [step(case.asked, list(range(start, start + len(case.asked))))]
    tokens = [int(logits[-1].argmax())]
    position = start + len(case.asked)
    while len(tokens) < new_tokens and tokens[-1] != stop:
        logits.append(step(tokens[-1:], [position]))
        tokens.append(int(logits[-1].argmax()))
        position += 1
    return tokens, torch.stack(logits)


@torch.no_grad()
def h2o_eval_side(model: Any, case: Case, new_tokens: int, stop: int) -> dict[str, Any]:
    """The case through h2o_eval's public API: its policy at budget 1 - ratio, ``rounding=down`` (a threshold
    press: ``dms`` at the threshold ``ratio``), as an ``EvictionCache`` with ``decoding=grow`` (``evict`` for a
    press that acts while decoding); the kept positions of every (layer, KV head) after the prompt and at the end,
    the greedy tokens and their logits."""
    from h2o_eval import EvictionCache, make_policy
    from h2o_eval.policies import Interval

    press = PRESSES[case.press]
    params = dict(press.params, **({"window": case.window} if press.delimiter else {}))
    if press.layered:
        params["budgets"] = [1 - ratio for ratio in layer_ratios(case.ratio, model.config.num_hidden_layers)]
    if press.threshold:
        policy = make_policy(press.policy, threshold=case.ratio, **params)
    else:
        policy = make_policy(press.policy, 1 - case.ratio, rounding="down", **params)
    protocol = "prefill" if press.query_aware else "context"
    if press.decoding:  # the context whole (DecodingPress) or compressed by the scorer, then interval compressions
        target = max(1, int(len(case.context) * (1 - case.ratio)))
        scorer = make_policy(press.policy, 1.0, **params)
        interval = {
            "size": Interval(INTERVAL, target_size=target, policy=scorer),
            "ratio": Interval(INTERVAL, target_ratio=case.ratio, policy=scorer),
            "prefill": Interval(INTERVAL, target_size=target),
        }[press.decoding]
        policy = policy if press.decoding == "prefill" else make_policy("full", 1.0)
        cache = EvictionCache(model, policy, protocol=protocol, decoding="interval", interval=interval)
    else:
        cache = EvictionCache(model, policy, protocol=protocol, decoding="evict" if press.drops else "grow")
    model(torch.tensor([case.context]), cache=cache, use_cache=True)
    kept = _held(cache)

    def step(ids: list[int], positions: list[int]) -> torch.Tensor:
        out = model(torch.tensor([ids]), cache=cache, position_ids=torch.tensor([positions]), use_cache=True)
        return out.logits[0, -1].float()

    # Re-rotated keys end at the prompt's last token, so the question follows it (kvpress: from the kept count).
    start = len(case.context) if press.rerotated else len(case.compressed)
    tokens, logits = greedy(step, case, start, new_tokens, stop)
    if press.decoding:  # a compression due after the last forward, which kvpress makes within it
        cache.prepare_decode()
    return {"kept": kept, "end": _held(cache), "tokens": tokens, "logits": logits}


def _held(cache: Any) -> list[list[list[int]]]:
    """Per layer and KV head the positions an ``EvictionCache`` holds."""
    return [
        [sorted(layer.position[0, head][layer.held[0, head]].tolist()) for head in range(layer.held.shape[1])]
        for layer in cache.layers
    ]


def kvpress_side(folder: str, jobs: list[Case], new_tokens: int, stop: int) -> list[dict[str, Any]]:
    """In the kvpress process: each case as kvpress's pipeline runs it (the press's hooks on the context's
    prefill, then :func:`greedy`)."""
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    models = {}

    def load(case: Case) -> Any:
        press = PRESSES[case.press]
        kind = ("eager" if press.eager else "sdpa", press.delimiter)
        if kind not in models:
            model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=kind[0]).eval()
            if press.delimiter:
                tokenizer = AutoTokenizer.from_pretrained(folder)
                press.kvpress(kvpress, 0.5).update_model_and_tokenizer(model, tokenizer)
                model.delimiter_id = tokenizer.convert_tokens_to_ids("<|finch_sep|>")
            models[kind] = model
        return models[kind]

    full_keys: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    results = []
    for case in jobs:
        print(f"kvpress: {case.press} {case.prompt} {case.ratio} {case.ties}", file=sys.stderr, flush=True)
        model = load(case)
        key = (tuple(case.context), model.config._attn_implementation)
        if key not in full_keys:
            with torch.no_grad():
                cache = DynamicCache()
                model.model(input_ids=torch.tensor([case.context]), past_key_values=cache)
            full_keys[key] = [layer.keys[0] for layer in cache.layers]
        try:
            results.append(_kvpress_case(kvpress, model, case, full_keys[key], new_tokens, stop))
        except (RuntimeError, AssertionError) as error:  # kvpress's own failure (SnapKV: a context under its window)
            results.append({"error": f"{type(error).__name__}: {error}"})
    return results


def _kvpress_case(kvpress: Any, model: Any, case: Case, full: list[torch.Tensor], new_tokens: int, stop: int):
    """One case through kvpress: the press's hooks on the prefill, the kept positions, then :func:`greedy`."""
    from transformers import DynamicCache

    spec = PRESSES[case.press]
    press = spec.kvpress(kvpress, case.ratio)
    if spec.layered:
        ratios = layer_ratios(case.ratio, model.config.num_hidden_layers)
        press = kvpress.PerLayerCompressionPress(press, compression_ratios=ratios)
    if spec.decoding:
        press = _decoding_press(kvpress, spec, case)
    if spec.delimiter:  # what update_model_and_tokenizer sets, the model being extended already
        press.delimiter_token, press.delimiter_token_id = "<|finch_sep|>", model.delimiter_id
    ids = [model.delimiter_id if token == DELIMITER else token for token in case.compressed]
    torch.manual_seed(SEED)
    cache = DynamicCache()
    fed = _noted(cache)  # every key written, in order: a decoding press's kept positions at the end
    rerotated: dict[int, list[list[int]]] = {}
    prefill = press(model) if spec.decoding in ("", "prefill") else contextlib.nullcontext()
    with torch.no_grad(), _ties(case.ties, in_order=bool(spec.decoding)), _rerotations(kvpress, rerotated), prefill:
        model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
    if PRESSES[case.press].rerotated:
        kept = [[sorted(head) for head in rerotated[layer]] for layer in range(len(cache.layers))]
    else:
        kept = _kept(model, cache, full)
    ratio = press.compression_ratio if PRESSES[case.press].threshold else None
    start = cache.get_seq_length() if PRESSES[case.press].rerotated else len(case.compressed)

    # Layers of different lengths: the SDPA mask transformers builds for several tokens fits the first layer only
    # (kvpress's PerLayerCompressionPress asks for flash attention; PyramidKV too), so the question goes one token at
    # a time.
    def step(ids: list[int], positions: list[int]) -> torch.Tensor:
        size = 1 if spec.layered or spec.uneven else len(ids)
        for first in range(0, len(ids), size):
            with torch.no_grad():
                out = model(
                    input_ids=torch.tensor([ids[first : first + size]]), past_key_values=cache,
                    position_ids=torch.tensor([positions[first : first + size]]), logits_to_keep=1,
                )  # fmt: skip
        return out.logits[0, -1].float()

    decoding = press(model) if spec.decoding or spec.drops else contextlib.nullcontext()
    with _ties(case.ties, in_order=bool(spec.decoding)), decoding:  # as kvpress's pipeline decodes
        tokens, logits = greedy(step, case, start, new_tokens, stop)
    end = _kept(model, cache, [layer.keys[0] for layer in cache.layers]) if spec.drops else None
    if spec.decoding and spec.policy != "adakv":  # (AdaKV's fake keys were never fed)
        end = _kept(model, cache, [torch.cat(fed[layer], dim=1) for layer in range(len(cache.layers))])
    return {"kept": kept, "end": end, "ratio": ratio, "tokens": tokens, "logits": logits}


def _noted(cache: Any) -> dict[int, list[torch.Tensor]]:
    """Notes per layer the keys each ``update`` writes into ``cache`` (batch row 0), in the order they come: the
    positions fed from 0 one after the other, a key's place among its layer's notes is its position."""
    fed: dict[int, list[torch.Tensor]] = {}
    update = cache.update

    def noted(keys: torch.Tensor, values: torch.Tensor, layer: int, *args: Any, **kwargs: Any) -> Any:
        fed.setdefault(layer, []).append(keys[0])
        return update(keys, values, layer, *args, **kwargs)

    cache.update = noted
    return fed


def _decoding_press(kvpress: Any, spec: Press, case: Case) -> Any:
    """The case's kvpress decoding press (:attr:`Press.decoding`), compressing every :data:`INTERVAL` forwards."""
    target = max(1, int(len(case.context) * (1 - case.ratio)))
    if spec.decoding == "ratio":
        return kvpress.CompressionRatioDecodingPress(
            base_press=spec.kvpress(kvpress, 0.0), compression_interval=INTERVAL, target_compression_ratio=case.ratio
        )
    decoding = kvpress.DecodingPress(spec.kvpress(kvpress, 0.0), compression_interval=INTERVAL, target_size=target)
    if spec.decoding == "size":
        return decoding
    return kvpress.PrefillDecodingPress(prefilling_press=spec.kvpress(kvpress, case.ratio), decoding_press=decoding)


def _kept(model: Any, cache: Any, full: list[torch.Tensor]) -> list[list[list[int]]]:
    """Per layer and KV head the positions kvpress kept: its kept keys found, bit for bit, among its full cache's
    keys, less AdaKV's masked keys."""
    kept = []
    for index, (layer, keys) in enumerate(zip(cache.layers, full, strict=True)):
        masked = getattr(model.model.layers[index].self_attn, "masked_key_indices", None)
        heads = []
        for head in range(keys.shape[0]):
            where = {row.numpy().tobytes(): position for position, row in enumerate(keys[head])}
            found = {where[row.numpy().tobytes()] for row in layer.keys[0, head]}
            if masked is not None:
                found -= set(masked[2][masked[1] == head].tolist())
            heads.append(sorted(found))
        kept.append(heads)
    return kept


class _rerotations:
    """Within the block, kvpress's ``KeyRerotationPress.rerotate_keys`` (which FINCH calls too) notes per layer the
    positions each KV head keeps in ``found``: re-rotated keys are no longer among the full cache's."""

    def __init__(self, kvpress: Any, found: dict[int, list[list[int]]]) -> None:
        self.press, self.found = kvpress.KeyRerotationPress, found

    def __enter__(self) -> None:
        self.saved = self.press.__dict__["rerotate_keys"]
        original, found = self.saved.__func__, self.found

        def noted(module: Any, indices: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
            found[module.layer_idx] = indices[0].tolist()
            return original(module, indices, keys)

        self.press.rerotate_keys = staticmethod(noted)

    def __exit__(self, *exc: Any) -> None:
        self.press.rerotate_keys = self.saved


class _ties:
    """Within the block, ``torch.topk`` (function and method) breaks ties towards the largest index, as h2o_eval
    keeps the newest of tied tokens (``newest``); ``topk``: as it is. ``ordered``, and ``newest`` with ``in_order``:
    the kept indices also come in increasing order, so that a cache compressed again (a decoding press's) stays in
    position order, where the largest index is the newest token."""

    def __init__(self, ties: str, in_order: bool = False) -> None:
        self.ties, self.in_order = ties, in_order

    def __enter__(self) -> None:
        self.saved = (torch.topk, torch.Tensor.topk)
        if self.ties == "topk":
            return
        original, newest, in_order = torch.topk, self.ties == "newest", self.in_order or self.ties == "ordered"

        def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
            if newest:
                return _newest_topk(self, k, dim, largest, sorted, in_order)
            indices = original(self, k, dim=dim, largest=largest, sorted=sorted).indices.sort(dim=dim).values
            return torch.return_types.topk((self.gather(dim, indices), indices))

        torch.topk = torch.Tensor.topk = topk

    def __exit__(self, *exc: Any) -> None:
        torch.topk, torch.Tensor.topk = self.saved


def _newest_topk(
    self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, in_order: bool = False
):
    ranked = self if largest else -self
    flipped = ranked.flip(dim)
    order = torch.argsort(flipped, dim=dim, descending=True, stable=True).narrow(dim, 0, k)
    indices = self.shape[dim] - 1 - order
    if in_order:
        indices = indices.sort(dim=dim).values
    return torch.return_types.topk((self.gather(dim, indices), indices))


def compare(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, bool, float]:
    """(layer-head pairs keeping the same tokens, after the prompt and, for a press that acts while decoding, at the
    end; tokens equal; the largest logit difference over the steps both sides reached with the same tokens)."""

    def equal(mine_kept: list, theirs_kept: list) -> str:
        pairs = [(a, b) for la, lb in zip(mine_kept, theirs_kept, strict=True) for a, b in zip(la, lb, strict=True)]
        return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"

    heads = equal(mine["kept"], theirs["kept"])
    if theirs.get("end") is not None:
        heads += f", at the end {equal(mine['end'], theirs['end'])}"
    same = 0
    while same < min(len(mine["tokens"]), len(theirs["tokens"])) and mine["tokens"][same] == theirs["tokens"][same]:
        same += 1
    steps = min(same + 1, len(mine["logits"]), len(theirs["logits"]))
    vocabulary = mine["logits"].shape[-1]
    difference = (mine["logits"][:steps] - theirs["logits"][:steps, :vocabulary]).abs().max()
    return heads, mine["tokens"] == theirs["tokens"], float(difference)


def run_kvpress(folder: Path, model_folder: str, jobs: list[Case], new_tokens: int, stop: int) -> list[dict[str, Any]]:
    """:func:`kvpress_side` in a subprocess whose path holds ``folder`` and a stub of ``datasets``."""
    with tempfile.TemporaryDirectory() as scratch:
        stub = Path(scratch) / "stub" / "datasets"
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text("def load_dataset(*args, **kwargs):\n    raise RuntimeError('no hub')\n")
        job, out = Path(scratch) / "job.json", Path(scratch) / "out.pt"
        job.write_text(json.dumps({"folder": model_folder, "new_tokens": new_tokens, "stop": stop,
                                   "cases": [dataclasses.asdict(case) for case in jobs]}))  # fmt: skip
        env = dict(os.environ, PYTHONPATH=f"{folder}{os.pathsep}{stub.parent}", TRANSFORMERS_VERBOSITY="error",
                   HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")  # fmt: skip
        subprocess.run([sys.executable, __file__, "--serve", str(job), str(out)], env=env, check=True)
        return torch.load(out)


def model_folder(name: str) -> str:
    """The folder kvpress loads the model from: a local path as it is, or the converted SmolLM2 h2o_eval caches."""
    if Path(name).is_dir():
        return name
    from h2o_eval import models

    if name != "smollm2-135m":
        raise SystemExit(f"--model {name}: kvpress loads a local folder; give one, or smollm2-135m")
    return str(models.cache_dir() / "models" / models.smollm2_gguf().stem)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvpress", type=Path, help="the folder kvpress 0.5.5 and its transformers are installed in")
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--presses", default=",".join(PRESSES), help=f"comma-separated, of {', '.join(PRESSES)}")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.75])
    parser.add_argument("--tasks", nargs="+", default=["niah_single_2", "vt", "qa_1"])
    parser.add_argument("--length", type=int, default=1024, help="the RULER prompts' length in tokens")
    parser.add_argument("--problems", type=int, default=3, help="the problems of each reasoning task (math500, ...)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--serve", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        job = json.loads(Path(args.serve[0]).read_text())
        jobs = [Case(**case) for case in job["cases"]]
        torch.save(kvpress_side(job["folder"], jobs, job["new_tokens"], job["stop"]), args.serve[1])
        return
    if args.kvpress is None or args.data_dir is None:
        parser.error("--kvpress and --data-dir are required")
    unknown = set(args.presses.split(",")) - set(PRESSES)
    if unknown:
        parser.error(f"unknown presses {', '.join(sorted(unknown))}: use {', '.join(PRESSES)}")

    from h2o_eval import load_model

    model, tokenizer = load_model(args.model, device="cpu")
    asked = prompts(tokenizer, args.data_dir, args.tasks, args.length, args.problems)
    jobs = cases(asked, args.presses.split(","), args.ratios)
    theirs = run_kvpress(args.kvpress, model_folder(args.model), jobs, args.new_tokens, tokenizer.eos_token_id)
    described = ", ".join(
        f"{name} (its first {args.problems} problems)" if _task(name).get("runner") == "reasoning"
        else f"RULER {name} at {args.length} tokens" for name in args.tasks
    )  # fmt: skip
    print(f"{args.model}, kvpress 0.5.5, {described}, {args.new_tokens} greedy tokens")
    print("| press | prompt | ratio | ties | T | C | heads equal | tokens equal | max logit diff |")
    print("|---|---|---:|---|---:|---:|---:|---|---:|")
    for case, kvpress_result in zip(jobs, theirs, strict=True):
        mine = h2o_eval_side(model, case, args.new_tokens, tokenizer.eos_token_id)
        held = sum(len(head) for layer in mine["kept"] for head in layer) / sum(len(layer) for layer in mine["kept"])
        if "error" in kvpress_result:
            print(f"| {case.press} | {case.prompt} | {case.ratio} | {case.ties} | {len(case.context)} | {held:g} | "
                  f"kvpress fails: {kvpress_result['error'][:80]} | | |", flush=True)  # fmt: skip
            continue
        heads, equal, difference = compare(mine, kvpress_result)
        if kvpress_result.get("ratio") is not None:  # a threshold: the compression ratio each side realised
            held = f"{held:g} (ratio {1 - held / len(case.context):.4f}, kvpress {kvpress_result['ratio']:.4f})"
            end = sum(len(head) for layer in mine["end"] for head in layer) / sum(len(layer) for layer in mine["end"])
            held += f", {end:g} at the end" if PRESSES[case.press].drops else ""
        elif PRESSES[case.press].decoding:  # what the last compressions left, of the tokens fed and generated
            prompt = len(case.compressed) + len(case.asked)
            fed = prompt + args.new_tokens - 1
            pairs = [head for layer in mine["end"] for head in layer]
            generated = sum(position >= prompt for head in pairs for position in head) / len(pairs)
            end = sum(len(head) for head in pairs) / len(pairs)
            held = f"{held:g}; at the end {end:g} of {fed}, {generated:g} of {fed - prompt} generated"
        print(f"| {case.press} | {case.prompt} | {case.ratio} | {case.ties} | {len(case.context)} | {held} | "
              f"{heads} | {equal} | {difference:.2e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
