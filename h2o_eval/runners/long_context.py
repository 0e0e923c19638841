"""The ``long_context`` runner: synthetic long-context tasks after RULER (Hsieh et al. 2024, arXiv:2404.06654):
needles in a haystack of real news text, variable tracking and common-words extraction, scored with RULER's
``string_match_all``.

A document is a pure function of (task parameters, tokenizer, haystack texts, seed, index, length, depth), so a
run is reproducible without storing data. Its prompt is fitted to ``length`` tokens of the model's own tokenizer
and kept as two token-id parts, tokenized separately: ``context_ids`` (chat-template head, instruction, haystack
with its needles) and ``question_ids`` (the question, the rest of the template, RULER's answer prefix), so that a
protocol can compress the context before the question is seen. Templates are RULER's
(``scripts/data/synthetic/constants.py``); where RULER draws keys and words from word lists, they are drawn from
the haystack's own vocabulary, and the asked needle sits at a chosen depth instead of a random one.
"""

from __future__ import annotations

import itertools
import random
import re
import string
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from h2o_eval.data import read_jsonl
from h2o_eval.errors import ConfigError
from h2o_eval.runners import Evaluation, Runner

FAMILIES = ("niah", "vt", "cwe")
# Where RULER puts needles it does not ask for: 40 evenly spaced depths (percent).
RULER_DEPTHS = tuple(round(100 * i / 39) for i in range(40))
# The default haystack under data_dir: (file, field holding the article).
DEFAULT_HAYSTACK = (("xsum/test.jsonl", "document"), ("cnn_dailymail/test.jsonl", "article"))
TEXT_FIELDS = ("document", "article", "text")
# Per family: the instruction before the context, the question after it, and the answer prefix that starts the
# model's turn (RULER's template split at {context}).
TEMPLATES = {
    "niah": (
        "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz "
        "you about the {type_v} afterwards.\n",
        "\nWhat are all the special magic {type_v} for {query} mentioned in the provided text?",
        " The special magic {type_v} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
        "\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n",
        "\nQuestion: What are the {num_cw} most common words in the above list?",
        " Answer: The top {num_cw} words that appear most often in the list are:",
    ),
}
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
WORD = re.compile(r"\b[a-z]{5,12}\b")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for these tasks: the share of expected strings found in the output, case-insensitive."""
    text = prediction.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def haystack_files(task: Mapping[str, Any], data_dir: str | Path | None) -> list[tuple[Path, str | None]]:
    """The haystack's JSONL files with the field holding each text (``None``: the first of ``TEXT_FIELDS``):
    ``task.haystack`` if set, else the XSUM and CNN/DM articles under ``data_dir``."""
    if task.get("haystack"):
        files = [(Path(task["haystack"]), task.get("text_field"))]
    elif data_dir is not None:
        files = [(Path(data_dir) / name, field) for name, field in DEFAULT_HAYSTACK]
    else:
        raise ConfigError(
            f"task {task['name']} needs a haystack of texts: set data_dir=PATH (its xsum and cnn_dailymail "
            "articles) or task.haystack=FILE.jsonl"
        )
    for path, _ in files:
        if not path.is_file():
            raise ConfigError(f"no haystack file {path}: put it there, or change data_dir or task.haystack")
    return files


def load_haystack(task: Mapping[str, Any], data_dir: str | Path | None) -> list[str]:
    """Every haystack text, in file order."""
    texts = []
    for path, field in haystack_files(task, data_dir):
        rows = read_jsonl(path, (field,) if field else ())
        name = field or next((f for f in TEXT_FIELDS if f in rows[0]), None)
        if name is None:
            raise ConfigError(f"{path} has none of the fields {', '.join(TEXT_FIELDS)}: set task.text_field=FIELD")
        texts += [row[name] for row in rows if isinstance(row[name], str) and row[name].strip()]
    if not texts:
        raise ConfigError(f"the haystack of task {task['name']} holds no text: check task.haystack and text_field")
    return texts


def check(task: Mapping[str, Any], data_dir: str | Path | None) -> None:
    """The task's own settings and its haystack, each refused with one line naming the fix."""
    if task.get("family") not in FAMILIES:
        raise ConfigError(f"task.family={task.get('family')!r}: use one of {', '.join(FAMILIES)}")
    length = task.get("length")
    if not isinstance(length, int) or isinstance(length, bool) or length < 64:
        raise ConfigError(f"task.length={length!r}: use a prompt length in tokens, an integer >= 64")
    depths = task.get("depths")
    if not depths or not all(isinstance(d, int | float) and 0 <= d <= 100 for d in depths):
        raise ConfigError(f"task.depths={depths!r}: use a list of needle depths in percent, each in [0, 100]")
    if not isinstance(task.get("samples"), int) or task["samples"] < 1:
        raise ConfigError(f"task.samples={task.get('samples')!r}: use a number of documents >= 1")
    load_haystack(task, data_dir)


def depth_of(task: Mapping[str, Any], index: int) -> float | None:
    """Documents cycle through the task's depths; common words have no needle, hence no depth."""
    return None if task["family"] == "cwe" else task["depths"][index % len(task["depths"])]


def make_document(
    task: Mapping[str, Any],
    tokenizer: Any,
    texts: Sequence[str],
    *,
    seed: int,
    index: int,
    length: int,
    depth: float | None,
) -> dict[str, Any]:
    """Document ``index`` of ``task``: its prompt fitted to at most ``length`` tokens (as close as one haystack
    word or list entry allows), as ``context_ids`` + ``question_ids``, with its ``answers`` and needle ``depth``."""
    rng = random.Random(f"{seed}-{task['name']}-{index}")
    family = task["family"]
    params = task.get("params") or {}
    if family == "cwe":
        return _common_words(task, tokenizer, texts, rng, params, index=index, length=length)
    stream = _sentences(texts, rng, length)
    counts = [len(ids) for ids in tokenizer([" " + s for s in stream], add_special_tokens=False).input_ids]
    if family == "niah":
        needles, answers, query = _needles(rng, stream, params)
        instruction, question, prefix = (part.format(type_v="numbers", query=query) for part in TEMPLATES["niah"])
    else:
        needles, answers, query, example = _chain(rng, params)
        instruction, question, prefix = (part.format(query=query, num_v=len(answers)) for part in TEMPLATES["vt"])
        instruction = example + "\n" + instruction
    # The asked needle (the first) sits at ``depth``; the others at RULER's random depths (vt: after the first,
    # in the chain's order).
    others = [_other_depth(rng, family, depth) for _ in needles[1:]]
    placed = [depth, *(sorted(others) if family == "vt" else others)]

    def build(words: int) -> tuple[str, str]:
        sentences, tokens = _first_words(stream, counts, words, tokenizer)
        return instruction + _insert(sentences, tokens, list(zip(placed, needles, strict=True))), question

    document = _fit(build, sum(len(s.split()) for s in stream), tokenizer, length, task["name"], prefix)
    return {**document, "index": index, "depth": depth, "answers": answers, "needles": needles}


def _sentences(texts: Sequence[str], rng: random.Random, length: int) -> list[str]:
    """Whole sentences of the haystack from a seeded order of its texts, at least ``length`` words of them
    (every word is at least one token), the texts cycled if they are too few."""
    order = list(range(len(texts)))
    rng.shuffle(order)
    sentences: list[str] = []
    words = 0
    for position in range(len(order) * (length + 1)):
        for sentence in SENTENCE_END.split(" ".join(texts[order[position % len(order)]].split())):
            sentences.append(sentence)
            words += len(sentence.split())
        if words >= length:
            return sentences
    return sentences


def _first_words(stream: list[str], counts: list[int], words: int, tokenizer: Any) -> tuple[list[str], list[int]]:
    """The first ``words`` words of ``stream`` as sentences (the last one cut), with each one's token count."""
    sentences, tokens = [], []
    for sentence, count in zip(stream, counts, strict=True):
        taken = sentence.split()[:words]
        if not taken:
            break
        words -= len(taken)
        cut = " ".join(taken)
        sentences.append(cut)
        tokens.append(count if cut == sentence else len(tokenizer(" " + cut, add_special_tokens=False).input_ids))
    return sentences, tokens


def _insert(sentences: list[str], tokens: list[int], needles: list[tuple[float, str]]) -> str:
    """The sentences joined, each needle put at the sentence boundary nearest to its depth, measured in tokens."""
    bounds = [0]
    for count in tokens:
        bounds.append(bounds[-1] + count)
    at: dict[int, list[str]] = {}
    for depth, needle in needles:
        target = depth / 100 * bounds[-1]
        boundary = min(range(len(bounds)), key=lambda k: (abs(bounds[k] - target), k))
        at.setdefault(boundary, []).append(needle)
    pieces = []
    for k in range(len(sentences) + 1):
        pieces += at.get(k, [])
        if k < len(sentences):
            pieces.append(sentences[k])
    return " ".join(pieces)


def _vocabulary(texts: Sequence[str] | list[str], exclude: str) -> list[str]:
    """Distinct lower-case words of 5-12 letters in order of first use, without the template's own words."""
    banned = set(WORD.findall(exclude.lower()))
    return [w for w in dict.fromkeys(w for text in texts for w in WORD.findall(text.lower())) if w not in banned]


def _needles(rng: random.Random, stream: list[str], params: Mapping[str, Any]) -> tuple[list[str], list[str], str]:
    """RULER's NIAH needles: ``keys`` keys (word pairs) with ``values`` 7-digit numbers each; ``queries`` keys are
    asked. The asked needles come first, the asked key's first value first of all."""
    keys, values, queries = params.get("keys", 1), params.get("values", 1), params.get("queries", 1)
    vocabulary = _vocabulary(stream, " ".join(TEMPLATES["niah"]))
    words = rng.sample(vocabulary, 2 * keys)
    names = [f"{words[2 * i]}-{words[2 * i + 1]}" for i in range(keys)]
    numbers = rng.sample(range(10**6, 10**7), keys * values)
    table = {name: [str(n) for n in numbers[i * values : (i + 1) * values]] for i, name in enumerate(names)}
    asked = names[:queries]
    answers = [value for name in asked for value in table[name]]
    needles = [NEEDLE.format(type_v="numbers", key=name, value=value) for name in names for value in table[name]]
    query = asked[0] if queries == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    return needles, answers, query


def _chain(rng: random.Random, params: Mapping[str, Any]) -> tuple[list[str], list[str], str, str]:
    """RULER's variable tracking: ``hops`` + 1 variables (5 capital letters) chained from a 5-digit value, and a
    solved example (3-letter variables in RULER's noise) before the instruction, as RULER's prompt has."""
    hops = params.get("hops", 4)

    def chain(letters: int) -> tuple[list[str], list[str], str]:
        names: list[str] = []
        while len(names) < hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=letters))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10000, 99999))
        statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
        return statements, names, value

    shown, shown_names, shown_value = chain(3)
    noise = [NOISE] * 5
    for statement, slot in zip(shown, sorted(rng.sample(range(len(noise) + len(shown)), len(shown))), strict=True):
        noise.insert(slot, statement)
    instruction, question, prefix = (part.format(query=shown_value, num_v=len(shown_names)) for part in TEMPLATES["vt"])
    example = instruction + " ".join(noise) + question + prefix + " ".join(shown_names)
    statements, names, value = chain(5)
    return statements, names, value, example


def _other_depth(rng: random.Random, family: str, depth: float) -> float:
    return rng.uniform(depth, 100) if family == "vt" else rng.choice(RULER_DEPTHS)


def _common_words(
    task: Mapping[str, Any],
    tokenizer: Any,
    texts: Sequence[str],
    rng: random.Random,
    params: Mapping[str, Any],
    *,
    index: int,
    length: int,
) -> dict[str, Any]:
    """RULER's common-words extraction: a numbered list where ``common`` words appear ``freq_common`` times and the
    rest ``freq_rare`` times (RULER's 30/3, or 6/1 below 4k tokens), after a solved smaller example."""
    common = params.get("common", 10)
    short = length < 4096
    freq_common = params.get("freq_common") or (6 if short else 30)
    freq_rare = params.get("freq_rare") or (1 if short else 3)
    order = list(range(len(texts)))
    rng.shuffle(order)
    vocabulary: list[str] = []
    template = " ".join(TEMPLATES["cwe"])
    for position in order:
        vocabulary = list(dict.fromkeys([*vocabulary, *_vocabulary([texts[position]], template)]))
        if len(vocabulary) >= length:
            break
    rng.shuffle(vocabulary)

    def numbered(words: list[str], high: int, low: int, shuffle: random.Random) -> str:
        entries = words[:common] * high + words[common:] * low
        shuffle.shuffle(entries)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(entries))

    instruction, question, prefix = (part.format(num_cw=common) for part in TEMPLATES["cwe"])
    shown = vocabulary[-(20 if short else 40) :]  # RULER's example: 20 or 40 words
    example_list = numbered(shown, 3 if short else 10, 1 if short else 3, random.Random(rng.random()))
    answer = " ".join(f"{i + 1}. {word}" for i, word in enumerate(shown[:common]))
    example = instruction + example_list + question + prefix + " " + answer + "\n"
    words = vocabulary[: -len(shown)]
    salt = rng.random()

    def build(distinct: int) -> tuple[str, str]:
        chosen = words[: common + distinct]
        listing = numbered(chosen, freq_common, freq_rare, random.Random(f"{salt}-{distinct}"))
        return example + instruction + listing, question

    if len(words) < common:
        raise ConfigError(f"the haystack of task {task['name']} has too few distinct words for {common} common ones")
    document = _fit(build, len(words) - common, tokenizer, length, task["name"], prefix)
    return {**document, "index": index, "depth": None, "answers": words[:common], "needles": []}


def _fit(
    build: Callable[[int], tuple[str, str]], most: int, tokenizer: Any, length: int, name: str, prefix: str
) -> dict[str, Any]:
    """The largest ``build(n)``, n <= ``most``, whose prompt is at most ``length`` tokens (binary search, as RULER
    fits its haystack), tokenized as context and question apart."""

    def encode(n: int) -> tuple[str, list[int], list[int]]:
        context, question = _wrap(tokenizer, *build(n), prefix)
        context_ids = tokenizer(context, add_special_tokens=False).input_ids
        question_ids = tokenizer(question, add_special_tokens=False).input_ids
        return context + question, context_ids, question_ids

    low, high = 0, most
    best = encode(0)
    if len(best[1]) + len(best[2]) > length:
        raise ConfigError(f"task.length={length} cannot hold task {name}'s template: use a larger task.length")
    while low < high:
        middle = (low + high + 1) // 2
        candidate = encode(middle)
        if len(candidate[1]) + len(candidate[2]) <= length:
            low, best = middle, candidate
        else:
            high = middle - 1
    prompt, context_ids, question_ids = best
    return {
        "prompt": prompt,
        "context_ids": context_ids,
        "question_ids": question_ids,
        "length": len(context_ids) + len(question_ids),
    }


def _wrap(tokenizer: Any, context: str, question: str, prefix: str) -> tuple[str, str]:
    """Context and question as the model reads them: inside its chat template (the user's turn, the answer prefix
    opening the assistant's) when it has one, else plain text ending with the answer prefix."""
    if not getattr(tokenizer, "chat_template", None):
        return context, question + prefix
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + question}], tokenize=False, add_generation_prompt=True
    )
    split = rendered.rindex(question)
    return rendered[:split], rendered[split:] + prefix.lstrip()


def documents(model: Any, tokenizer: Any, config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The run's documents (the first ``limit`` of ``task.samples``), after checking that prompt and answer fit in
    the model's positions."""
    task, limit = config["task"], config["limit"]
    positions = getattr(model.config, "max_position_embeddings", None)
    new_tokens = task["max_new_tokens"]
    if positions is not None and task["length"] + new_tokens > positions:
        raise ConfigError(
            f"task.length={task['length']} plus {new_tokens} new tokens exceeds {config['model']['name']}'s "
            f"{positions} positions: use task.length <= {positions - new_tokens}"
        )
    texts = load_haystack(task, config["data_dir"])
    count = (
        task["samples"]
        if limit is None
        else min(task["samples"], limit if isinstance(limit, int) else int(limit * task["samples"]))
    )
    return [
        make_document(
            task, tokenizer, texts, seed=config["seed"], index=i, length=task["length"], depth=depth_of(task, i)
        )
        for i in range(count)
    ]


def batches(docs: list[dict[str, Any]], protocol: str, batch_size: int) -> list[list[dict[str, Any]]]:
    """Documents in batches of ``batch_size``; with ``protocol=context`` a batch holds questions of one length, so
    that the contexts end in one column and are compressed before the questions arrive."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for document in docs:
        groups.setdefault(len(document["question_ids"]) if protocol == "context" else 0, []).append(document)
    return [group[i : i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]


def _batch(docs: list[dict[str, Any]], protocol: str, tokenizer: Any, device: Any):
    from h2o_eval.generation import make_batch

    contexts, questions = [d["context_ids"] for d in docs], [d["question_ids"] for d in docs]
    return make_batch(contexts, questions, tokenizer.pad_token_id, device, split=protocol == "context")


def _greedy(task: Mapping[str, Any], tokenizer: Any) -> dict[str, Any]:
    return {
        "max_new_tokens": task["max_new_tokens"],
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _outputs(docs: list[dict[str, Any]], generated: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """Per-document outputs of one generated batch: the answer, scored."""
    rows = []
    for document, row in zip(docs, generated, strict=True):
        prediction = tokenizer.decode(row.pop("tokens"), skip_special_tokens=True).strip()
        rows.append(
            {
                "id": document["index"],
                "depth": document["depth"],
                "context_tokens": len(document["context_ids"]),
                "answers": document["answers"],
                "prediction": prediction,
                "scores": {"string_match_all": string_match_all(prediction, document["answers"])},
                **row,
                "needles": document["needles"],
                "prompt": document["prompt"],
            }
        )
    return rows


def _evaluation(task: Mapping[str, Any], outputs: list[dict[str, Any]], log: Any) -> Evaluation:
    outputs.sort(key=lambda o: o["id"])
    n = max(len(outputs), 1)
    fields = {
        "metrics": {"string_match_all": sum(o["scores"]["string_match_all"] for o in outputs) / n},
        "n_samples": len(outputs),
        "length": task["length"],
        **log.fields(),
    }
    return Evaluation(fields, outputs)


class LongContextRunner(Runner):
    """Generate the run's documents and answer each greedily through an EvictionCache (stopping at end of sequence
    or ``task.max_new_tokens``), scored with RULER's ``string_match_all``."""

    name = "long_context"

    def default_protocol(self, task: Mapping[str, Any]) -> str:
        return "prefill"

    def check(self, config: Mapping[str, Any]) -> None:
        check(config["task"], config["data_dir"])
        if config["num_fewshot"]:
            raise ConfigError(
                f"task {config['task']['name']} has no few-shot examples: drop num_fewshot={config['num_fewshot']}"
            )

    def data_files(self, task: Mapping[str, Any], data_dir: str | Path | None) -> list[Path]:
        return [path for path, _ in haystack_files(task, data_dir)]

    def evaluate(self, model: Any, tokenizer: Any, policy: Any, config: Mapping[str, Any]) -> Evaluation:
        return self.evaluate_shared(model, tokenizer, [(policy, config)])[0]

    def shares_prompts(self, config: Mapping[str, Any]) -> bool:
        return config["protocol"] in ("prefill", "context")

    def evaluate_shared(
        self, model: Any, tokenizer: Any, cells: Sequence[tuple[Any, Mapping[str, Any]]]
    ) -> list[Evaluation]:
        """The cells' evaluations; they differ only in policy, budget and protocol. Per batch and protocol, the
        first chunk (the prompt in ``prefill``, the context in ``context``), which attends in full whatever the
        policy, runs once through a :class:`~h2o_eval.cache.SharedPrompt` of every cell's cache, each compressing it
        by its own policy; each cell then generates alone. In ``prefill`` the shared pass also chooses the first new
        token (``generate`` with one new token), which depends on the prompt alone. A single cell, or ``simulate``,
        is the plain generation path. A cell's ``generated_tokens_per_s`` counts its share of the shared pass."""

        import torch
        from tqdm import tqdm

        from h2o_eval import generation
        from h2o_eval.cache import EvictionCache, SharedPrompt

        config = cells[0][1]
        task = config["task"]
        docs = documents(model, tokenizer, config)
        device = next(model.parameters()).device
        greedy = _greedy(task, tokenizer)
        ends = generation.end_tokens(tokenizer)
        logs = [generation.GenerationLog(max_new_tokens=task["max_new_tokens"]) for _ in cells]
        outputs: list[list[dict[str, Any]]] = [[] for _ in cells]
        protocols = sorted({cell["protocol"] for _, cell in cells})
        label = f"generating {task['name']}" + (f" x {len(cells)} cells" if len(cells) > 1 else "")
        progress = tqdm(total=len(docs) * len(protocols), desc=label, unit="doc")
        for protocol in protocols:
            members = [i for i, (_, cell) in enumerate(cells) if cell["protocol"] == protocol]
            for group in batches(docs, protocol, config["batch_size"]):
                batch = _batch(group, protocol, tokenizer, device)
                if len(members) == 1 or protocol == "simulate":
                    for i in members:
                        generated = generation.run_batch(
                            model,
                            cells[i][0],
                            batch,
                            logs[i],
                            ends,
                            protocol=protocol,
                            kernels=config["kernels"],
                            **greedy,
                        )
                        outputs[i] += _outputs(group, generated, tokenizer)
                    progress.update(len(group))
                    continue
                caches = {
                    i: EvictionCache(model, cells[i][0], protocol=protocol, kernels=config["kernels"]) for i in members
                }
                began = time.perf_counter()
                shared = SharedPrompt(list(caches.values()))
                ids, mask, new_tokens = batch.input_ids, batch.attention_mask, task["max_new_tokens"]
                if batch.context_width is not None and batch.context_width < ids.shape[1]:
                    generation.feed_context(model, shared, batch)
                else:
                    ids = generation.decode(model, shared, ids, mask, **greedy | {"max_new_tokens": 1})
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
                    new_tokens -= 1
                share = (time.perf_counter() - began) / len(members)
                del shared  # it holds every cache's layers: each cache is freed once its cell has generated
                for i in members:
                    cache = caches.pop(i)
                    began = time.perf_counter()
                    sequences = ids
                    if new_tokens > 0:
                        sequences = generation.decode(
                            model, cache, ids, mask, **greedy | {"max_new_tokens": new_tokens}
                        )
                    seconds = share + time.perf_counter() - began
                    outputs[i] += _outputs(group, logs[i].add(batch, sequences, cache, seconds, ends), tokenizer)
                progress.update(len(group))
        progress.close()
        return [_evaluation(task, rows, log) for rows, log in zip(outputs, logs, strict=True)]


RUNNER = LongContextRunner()
