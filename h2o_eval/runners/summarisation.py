"""The ``summarisation`` runner: XSUM and CNN/DM under real KV eviction. HELM-style prompts from
``tasks/<template>.yaml``, generated on the one generation path (:mod:`h2o_eval.generation`), ROUGE-1/2/L
F-measures (stemmed) from ``rouge-score``."""

from __future__ import annotations

import random
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from h2o_eval import hub
from h2o_eval.data import first, read_jsonl, split_file
from h2o_eval.errors import ConfigError
from h2o_eval.runners import Evaluation, Runner

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
GENERATION = ("max_new_tokens", "max_words", "sample", "temperature", "top_p")  # the generation settings it reads


def template(task: Mapping[str, Any]) -> dict[str, Any]:
    return yaml.safe_load((resources.files("h2o_eval.tasks") / f"{task['template']}.yaml").read_text())


def local_data_file(task: Mapping[str, Any], data_dir: str | Path) -> Path:
    return split_file(data_dir, task["name"], task["split"])


def load_documents(task: Mapping[str, Any], data_dir: str | Path | None) -> list[dict[str, Any]]:
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


def rouge(predictions: list[str], references: list[str]) -> list[dict[str, float]]:
    """Per-document ROUGE-1/2/L F-measures with stemming (``rouge-score``)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    return [
        {name: score.fmeasure for name, score in scorer.score(reference, prediction).items()}
        for prediction, reference in zip(predictions, references, strict=True)
    ]


def _check_settings(settings: Mapping[str, Any]) -> None:
    for key in ("max_new_tokens", "max_words"):
        value = settings[key]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"generation.{key}={value!r}: use an integer >= 1, or null for the task's default")


class SummarisationRunner(Runner):
    """Generate and score a summary per document."""

    name = "summarisation"
    generation = GENERATION

    def default_protocol(self, task: Mapping[str, Any]) -> str:
        return "prefill"

    def default_fewshot(self, task: Mapping[str, Any]) -> int:
        return template(task)["num_fewshot"]

    def check(self, config: Mapping[str, Any]) -> None:
        _check_settings(config["generation"])
        task = config["task"]
        for path in self.data_files(task, config["data_dir"]):
            read_jsonl(path, tuple(template(task)["fields"].values()))
        if config["data_dir"] is None:
            hub.check_dataset(task["name"], task["hub"]["path"])

    def data_files(self, task: Mapping[str, Any], data_dir: str | Path | None) -> list[Path]:
        return [] if data_dir is None else [local_data_file(task, data_dir)]

    def identity(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The ``generation`` settings it reads (not ``samples``: the reasoning tasks')."""
        return {"generation": {key: config["generation"][key] for key in GENERATION}}

    def evaluate(self, model: Any, tokenizer: Any, policy: Any, config: Mapping[str, Any]) -> Evaluation:
        """A summary per document (the first ``limit``), ``batch_size`` at a time; ROUGE against the reference."""
        import torch

        from h2o_eval import generation
        from h2o_eval.policies import configured_interval

        task, protocol, settings = config["task"], config["protocol"], config["generation"]
        form = template(task)
        documents = load_documents(task, config["data_dir"])
        indices = list(range(first(len(documents), config["limit"])))
        max_words = settings["max_words"] or form["max_words"]
        max_new_tokens = settings["max_new_tokens"] or form["max_new_tokens"]
        prompts = build_prompts(documents, form, indices, config["num_fewshot"], config["seed"], max_words)
        if protocol == "context":
            parts = [split_question(p, form["question"]) for p in prompts]
            contexts = [tokenizer(c).input_ids for c, _ in parts]
            questions = [tokenizer(q, add_special_tokens=False).input_ids for _, q in parts]
        else:
            contexts, questions = [tokenizer(p).input_ids for p in prompts], [[] for _ in prompts]
        device = next(model.parameters()).device
        log = generation.GenerationLog(max_new_tokens=max_new_tokens)
        outputs: list[dict[str, Any]] = []
        with generation.Progress(len(indices), f"generating {task['name']}", "document") as progress:
            batch_size = config["batch_size"]
            for start in range(0, len(indices), batch_size):
                rows = slice(start, start + batch_size)
                batch = generation.make_batch(
                    contexts[rows], questions[rows], tokenizer.pad_token_id, device, split=protocol == "context"
                )
                torch.manual_seed(config["seed"] + start)
                generated = generation.run_batch(
                    model,
                    policy,
                    batch,
                    log,
                    tokenizer,
                    protocol=protocol,
                    kernels=config["kernels"],
                    decoding=config["decoding"],
                    graphs=config["graphs"],
                    interval=configured_interval(config, policy),
                    max_new_tokens=max_new_tokens,
                    do_sample=settings["sample"],
                    temperature=settings["temperature"] if settings["sample"] else None,
                    top_p=settings["top_p"] if settings["sample"] else None,
                    top_k=None,
                    stop_strings=[form["stop"]],
                    pad_token_id=tokenizer.pad_token_id,
                )
                for row, index in zip(generated, indices[rows], strict=True):
                    text = tokenizer.decode(row.pop("tokens"), skip_special_tokens=True).split(form["stop"])[0].strip()
                    document = documents[index]
                    outputs.append(
                        {
                            "id": document[form["fields"]["id"]],
                            "prediction": text,
                            "reference": document[form["fields"]["summary"]],
                            **row,
                        }
                    )
                progress.update(len(generated))
        scores = rouge([o["prediction"] for o in outputs], [o["reference"] for o in outputs])
        for output, score in zip(outputs, scores, strict=True):
            output["scores"] = score
        n = max(len(outputs), 1)
        fields = {
            "metrics": {name: sum(s[name] for s in scores) / n for name in ROUGE_TYPES},
            "n_samples": len(outputs),
            **log.fields(),
        }
        fields["generation"] |= {
            "num_fewshot": config["num_fewshot"],
            "max_words": max_words,
            "sample": settings["sample"],
        }
        return Evaluation(fields, outputs)


RUNNER = SummarisationRunner()
