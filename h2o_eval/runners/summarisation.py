"""Summarisation under real KV eviction: prompts from ``tasks/<template>.yaml``, ``generate()`` with an
:class:`~h2o_eval.cache.EvictionCache`, ROUGE-1/2/L F-measures (stemmed) from ``rouge-score``."""

from __future__ import annotations

import random
import time
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from h2o_eval.data import read_jsonl
from h2o_eval.errors import ConfigError

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def template(task: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load((resources.files("h2o_eval.tasks") / f"{task['template']}.yaml").read_text())


def local_data_file(task: dict[str, Any], data_dir: str | Path) -> Path:
    path = Path(data_dir) / task["name"] / f"{task['split']}.jsonl"
    if not path.is_file():
        raise ConfigError(f"no data file {path}: put it there or change data_dir={data_dir}")
    return path


def load_documents(task: dict[str, Any], data_dir: str | Path | None) -> list[dict[str, Any]]:
    """The task's split: ``<data_dir>/<task>/<split>.jsonl`` if ``data_dir`` is set, else the Hugging Face hub."""
    if data_dir is not None:
        return read_jsonl(local_data_file(task, data_dir), tuple(template(task)["fields"].values()))
    import datasets

    return list(datasets.load_dataset(task["hub"]["path"], task["hub"]["name"], split=task["split"]))


def _words(text: str, limit: int) -> str:
    return " ".join(text.split()[:limit])


def build_prompts(
    documents: list[dict[str, Any]],
    form: dict[str, Any],
    indices: list[int],
    num_fewshot: int,
    seed: int,
    max_words: int,
) -> list[str]:
    """One prompt per document in ``indices``: ``num_fewshot`` solved examples, then the document itself.

    The examples are the first ones of a seeded shuffle of the split that are not the document being
    summarised, so every prompt shows the same examples except where one of them is the query.
    """
    fields = form["fields"]
    pool = list(range(len(documents)))
    random.Random(seed).shuffle(pool)

    def render(part: str, doc: dict[str, Any]) -> str:
        return form[part].format(
            document=_words(doc[fields["document"]], max_words), summary=" ".join(doc[fields["summary"]].split())
        )

    prompts = []
    for index in indices:
        shots = [i for i in pool[: num_fewshot + 1] if i != index][:num_fewshot]
        prompts.append("".join(render("shot", documents[i]) for i in shots) + render("query", documents[index]))
    return prompts


def split_question(prompt: str, question: str) -> tuple[str, str]:
    """(context, question) of a prompt that ends with ``question`` (the instruction that follows the document)."""
    if not prompt.endswith(question):
        raise ConfigError(f"protocol=context: the prompt does not end with its question {question!r}")
    return prompt[: len(prompt) - len(question)], question


def encode(tokenizer: Any, parts: list[tuple[str, str]], protocol: str, device: Any) -> tuple[Any, Any, int | None]:
    """A batch of (context, question) prompts as left-padded ``input_ids`` and ``attention_mask``, and, for the
    ``context`` protocol, the width of the context columns: contexts and questions are tokenized apart (the
    question without special tokens), and every question must have the same length, so that the contexts end in
    one column. Other protocols tokenize each prompt whole (width None)."""

    if protocol != "context":
        batch = tokenizer([c + q for c, q in parts], return_tensors="pt", padding=True).to(device)
        return batch.input_ids, batch.attention_mask, None
    contexts = [tokenizer(c).input_ids for c, _ in parts]
    questions = [tokenizer(q, add_special_tokens=False).input_ids for _, q in parts]
    return pad_context(contexts, questions, tokenizer.pad_token_id, device)


def pad_context(contexts: list[list[int]], questions: list[list[int]], pad: int, device: Any) -> tuple[Any, Any, int]:
    """Token-id contexts left-padded to one width, each followed by its question (all of one length), so that
    every context ends in the same column: (``input_ids``, ``attention_mask``, that width)."""
    import torch

    if len({len(q) for q in questions}) != 1:
        raise ValueError("a context-protocol batch needs questions of one length: batch them by length")
    width = max(len(c) for c in contexts)
    ids = [[pad] * (width - len(c)) + c + q for c, q in zip(contexts, questions, strict=True)]
    mask = [[0] * (width - len(c)) + [1] * (len(c) + len(q)) for c, q in zip(contexts, questions, strict=True)]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device), width


def feed_context(model: Any, cache: Any, input_ids: Any, attention_mask: Any, context_width: int | None) -> None:
    """With a ``context_width``, feed the context columns through ``cache`` as one chunk: the cache prefills and
    compresses them before the question exists. Nothing to do without one, or with an empty question (as
    prefill)."""
    import torch

    if context_width is None or context_width >= input_ids.shape[1]:
        return
    mask = attention_mask[:, :context_width]
    with torch.no_grad():
        model(
            input_ids[:, :context_width],
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the context's own logits are never read
        )


def generate(model: Any, cache: Any, input_ids: Any, attention_mask: Any, context_width: int | None, **kwargs: Any):
    """``model.generate`` through ``cache``, the context columns fed first (:func:`feed_context`); ``generate``
    then feeds the question under the policy's decoding rule, and decodes."""
    import torch

    feed_context(model, cache, input_ids, attention_mask, context_width)
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **kwargs)


def rouge(predictions: list[str], references: list[str]) -> list[dict[str, float]]:
    """Per-document ROUGE-1/2/L F-measures with stemming (``rouge-score``)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    return [
        {name: score.fmeasure for name, score in scorer.score(reference, prediction).items()}
        for prediction, reference in zip(predictions, references, strict=True)
    ]


def summarise(
    model: Any,
    tokenizer: Any,
    task: dict[str, Any],
    policy: Any,
    *,
    protocol: str,
    data_dir: str | Path | None,
    num_fewshot: int,
    limit: int | float | None,
    batch_size: int,
    seed: int,
    settings: dict[str, Any],
    kernels: str,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Generate and score a summary per document. Returns (record fields, per-document outputs)."""
    import torch
    from tqdm import tqdm

    from h2o_eval.cache import EvictionCache

    form = template(task)
    documents = load_documents(task, data_dir)
    count = len(documents) if limit is None else (limit if isinstance(limit, int) else int(limit * len(documents)))
    indices = list(range(min(count, len(documents))))
    max_words = settings["max_words"] or form["max_words"]
    max_new_tokens = settings["max_new_tokens"] or form["max_new_tokens"]
    prompts = build_prompts(documents, form, indices, num_fewshot, seed, max_words)
    parts = [split_question(p, form["question"]) if protocol == "context" else (p, "") for p in prompts]
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    entry_bytes = 2 * config.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()

    outputs: list[dict[str, Any]] = []
    generated_tokens = decode_seconds = peak_entries = full_entries = 0
    progress = tqdm(total=len(indices), desc=f"generating {task['name']}", unit="doc")
    for start in range(0, len(indices), batch_size):
        input_ids, attention_mask, width = encode(tokenizer, parts[start : start + batch_size], protocol, device)
        cache = EvictionCache(model, policy, protocol=protocol, kernels=kernels)
        torch.manual_seed(seed + start)
        began = time.perf_counter()
        sequences = generate(
            model,
            cache,
            input_ids,
            attention_mask,
            width,
            max_new_tokens=max_new_tokens,
            do_sample=settings["sample"],
            temperature=settings["temperature"] if settings["sample"] else None,
            top_p=settings["top_p"] if settings["sample"] else None,
            top_k=None,
            stop_strings=[form["stop"]],
            tokenizer=tokenizer,
            pad_token_id=tokenizer.pad_token_id,
        )
        decode_seconds += time.perf_counter() - began
        new_tokens = sequences[:, input_ids.shape[1] :]
        prompt_lengths = attention_mask.sum(-1).tolist()
        peak_entries = max(peak_entries, cache.peak_entries)
        # What a full cache would hold: the longest prompt plus every fed step (the last token is never fed).
        full_entries = max(full_entries, max(prompt_lengths) + new_tokens.shape[1] - 1)
        capacity = cache.capacity()
        for row, index in enumerate(indices[start : start + batch_size]):
            padding = new_tokens[row] == tokenizer.pad_token_id
            length = int(padding.int().argmax()) if bool(padding.any()) else new_tokens.shape[1]
            tokens = new_tokens[row]
            text = tokenizer.decode(tokens[:length], skip_special_tokens=True).split(form["stop"])[0].strip()
            generated_tokens += length
            outputs.append(
                {
                    "id": documents[index][form["fields"]["id"]],
                    "prediction": text,
                    "reference": documents[index][form["fields"]["summary"]],
                    "prompt_tokens": prompt_lengths[row],
                    "generated_tokens": length,
                    "capacity": min(round(float(capacity[row]), 2), prompt_lengths[row] + length),
                    "budget_tokens": cache.lengths[row],
                }
            )
        progress.update(len(indices[start : start + batch_size]))
        progress.set_postfix(tokens_per_s=f"{generated_tokens / decode_seconds:.1f}")
    progress.close()

    scores = rouge([o["prediction"] for o in outputs], [o["reference"] for o in outputs])
    for output, score in zip(outputs, scores, strict=True):
        output["scores"] = score
    n = max(len(outputs), 1)
    prompt_mean = sum(o["prompt_tokens"] for o in outputs) / n
    fields = {
        "metrics": {name: sum(s[name] for s in scores) / n for name in ROUGE_TYPES},
        "n_samples": len(outputs),
        "generation": {
            "num_fewshot": num_fewshot,
            "max_words": max_words,
            "max_new_tokens": max_new_tokens,
            "sample": settings["sample"],
            "prompt_tokens_mean": prompt_mean,
            "generated_tokens_mean": generated_tokens / n,
            "generated_tokens_per_s": generated_tokens / decode_seconds if decode_seconds else 0.0,
            "kv_peak_entries": peak_entries,
            "kv_peak_bytes": peak_entries * entry_bytes,
            "kv_full_entries": full_entries,
            "kv_full_bytes": full_entries * entry_bytes,
        },
        "capacity": capacity_stats(outputs),
    }
    return fields, outputs


def capacity_stats(outputs: list[dict[str, Any]]) -> dict[str, float]:
    """The record's ``capacity`` of a generation run, from its per-document outputs (the ``capacity`` each one's
    cache had, and ``budget_tokens``, the length its budget applied to: the prompt, or the context under
    ``protocol=context``), as the log-likelihood runs report it: the full cache keeps 100 %."""
    n = max(len(outputs), 1)
    return {
        "sequences": len(outputs),
        "length_mean": sum(o["budget_tokens"] for o in outputs) / n,
        "capacity_mean": sum(o["capacity"] for o in outputs) / n,
        "capacity_min": min((o["capacity"] for o in outputs), default=0),
        "capacity_max": max((o["capacity"] for o in outputs), default=0),
        "kept_fraction_mean": sum(o["capacity"] / o["budget_tokens"] for o in outputs) / n,
    }
