"""The ``reasoning`` runner: MATH-500, AIME 2024/2025 and GSM8K, where the cache grows with a long answer and
decode-time eviction (``decoding=evict``, ``interval``, a ``threshold``) matters most.

Each problem is asked as kvpress's evaluation asks MATH-500 and AIME 2025 (``evaluation/evaluate.py`` with its
pipeline, kvpress 0.5.5): a context of one space and the problem as the question, in the model's chat template
(``enable_thinking=False``), no answer prefix, greedy decoding up to the task's ``max_new_tokens``. Three scores per
problem:

- ``accuracy``: kvpress's scorer (``evaluation/benchmarks/{math500,aime25}/calculate_metrics.py``), the text after
  the first (MATH-500) or last (AIME) ``boxed{`` up to the next ``}``, equal as a string to the answer; GSM8K's is
  the last number of the answer equal to the number after the reference's ``####`` (commas, ``$`` and a final
  ``.`` dropped, as lm-eval's ``gsm8k`` compares them);
- ``math_verify``: math-verify's ``verify`` of the answer parsed from the prediction against the reference, which
  takes equal values written differently (``\\frac12`` and ``0.5``) and nested braces;
- ``answered``: whether the prediction holds ``boxed{`` (GSM8K: a number).

Problems decode ``batch_size`` at a time, each leaving its batch as its solution ends
(:func:`~h2o_eval.generation.run_batch` with ``leaving``). Greedy by default; ``generation.sample=true`` draws
``generation.samples`` solutions per problem (``temperature``, ``top_p``), the ``s``-th of every problem after
``torch.manual_seed(seed + s)``: the scores are their means (pass@1), with pass@k (:func:`pass_at`) for every power
of two k up to the samples, and the record names the seeds.

Agreement with the full cache (greedy runs): the full cache's solutions to the same problems are read from its
record in ``results_dir`` (the run's settings with ``policy=full``, ``decoding=evict``, no threshold), or generated
once per process where there is none. ``metrics.agreement`` is the share of problems whose final answer (what the
scorer reads: the boxed text, GSM8K's last number, or none) equals the full cache's, and ``generation`` holds the
median position of the first generated token that differs from the full cache's trace (:func:`first_difference`)
and the share of traces equal to it.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from h2o_eval.data import first, read_jsonl, split_file
from h2o_eval.errors import ConfigError
from h2o_eval.runners import Evaluation, Runner

SCORERS = ("first_boxed", "last_boxed", "gsm8k")
SCORES = ("accuracy", "math_verify", "answered")
NUMBER = re.compile(r"-?[$0-9.,]{2,}|-?[0-9]+")  # lm-eval gsm8k's flexible-extract: the last number


def kvpress_boxed(prediction: str, answer: Any, last: bool) -> bool:
    """kvpress's ``score_aime``: the text after the first (``last``: the last) ``boxed{`` up to the next ``}``, equal
    as a string to ``str(answer)``; no ``boxed{`` is wrong."""
    found = boxed(prediction, last)
    return found is not None and found == str(answer)


def boxed(prediction: str, last: bool) -> str | None:
    """The text after the first (``last``: the last) ``boxed{`` up to the next ``}``, or None without one."""
    parts = prediction.split("boxed{")
    return None if len(parts) < 2 else parts[-1 if last else 1].split("}")[0]


def final_answer(task: Mapping[str, Any], prediction: str) -> str | None:
    """The answer the task's accuracy scorer reads from a prediction: the boxed text, or GSM8K's last number."""
    if task["scorer"] == "gsm8k":
        return gsm8k_prediction(prediction)
    return boxed(prediction, last=task["scorer"] == "last_boxed")


def first_difference(tokens: list[int], reference: list[int]) -> int:
    """The position of the first generated token that departs from ``reference``'s trace: the first that differs,
    or where one trace ends before the other; a trace equal to the reference gives its length."""
    for position, (token, expected) in enumerate(zip(tokens, reference, strict=False)):
        if token != expected:
            return position
    return min(len(tokens), len(reference))


def pass_at(samples: int, correct: int, k: int) -> float:
    """The chance that at least one of k of a problem's ``samples`` solutions, ``correct`` of them right, is right:
    the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k), as lighteval computes pass@k."""
    if samples - correct < k:
        return 1.0
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def gsm8k_reference(answer: str) -> str:
    """The number after GSM8K's ``####``."""
    return _plain(answer.split("####")[-1])


def gsm8k_prediction(prediction: str) -> str | None:
    """The last number of a prediction (lm-eval's ``flexible-extract``), or None."""
    found = NUMBER.findall(prediction)
    return _plain(found[-1]) if found else None


def _plain(number: str) -> str:
    return number.strip().replace(",", "").replace("$", "").rstrip(".")


def math_verify(prediction: str, reference: str) -> bool:
    """math-verify's verdict on the answer parsed from ``prediction`` against ``reference``, with its timeouts (5 s
    each) in the main thread, where its signal-based timeouts work, and without them elsewhere."""
    from math_verify import parse, verify

    timed = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
    gold = parse(f"${reference}$", **timed)
    found = parse(prediction, **timed)
    checked = {} if timed == {} else {"timeout_seconds": None}
    return bool(gold and found and verify(gold, found, **checked))


def scores(task: Mapping[str, Any], prediction: str, answer: str) -> dict[str, float]:
    """A prediction's ``accuracy``, ``math_verify`` and ``answered`` (see the module)."""
    if task["scorer"] == "gsm8k":
        reference, found = gsm8k_reference(answer), gsm8k_prediction(prediction)
        return {
            "accuracy": float(found == reference),
            "math_verify": float(math_verify(prediction, reference)),
            "answered": float(found is not None),
        }
    return {
        "accuracy": float(kvpress_boxed(prediction, answer, last=task["scorer"] == "last_boxed")),
        "math_verify": float(math_verify(prediction, answer)),
        "answered": float("boxed{" in prediction),
    }


def read_problems(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The run's problems: the first ``limit`` of its task's file."""
    task = config["task"]
    problems = read_jsonl(data_file(task, config["data_dir"]), (task["problem"], task["answer"]))
    return problems[: first(len(problems), config["limit"])]


def data_file(task: Mapping[str, Any], data_dir: str | Path | None) -> Path:
    if data_dir is None:
        raise ConfigError(f"task={task['name']} reads {task['name']}/{task['split']}.jsonl: set data_dir to its folder")
    return split_file(data_dir, task["name"], task["split"])


class ReasoningRunner(Runner):
    """Generate a solution per problem (or several, sampled) and score its final answer."""

    name = "reasoning"
    generation = ("sample", "temperature", "top_p", "samples")

    def default_protocol(self, task: Mapping[str, Any]) -> str:
        return "prefill"

    def identity(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Sampling's settings, where it samples (a greedy run's identity has none)."""
        settings = config["generation"]
        if not settings["sample"]:
            return {}
        return {"generation": {key: settings[key] for key in self.generation}}

    def check(self, config: Mapping[str, Any]) -> None:
        task, settings = config["task"], config["generation"]
        if task["scorer"] not in SCORERS:
            raise ConfigError(f"task.scorer={task['scorer']!r}: use one of {', '.join(SCORERS)}")
        value = task["max_new_tokens"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"task.max_new_tokens={value!r}: use an integer >= 1")
        samples = settings["samples"]
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
            raise ConfigError(f"generation.samples={samples!r}: use an integer >= 1")
        if samples > 1 and not settings["sample"]:
            raise ConfigError(
                f"generation.samples={samples} would repeat one greedy solution: set generation.sample=true"
            )
        if config["num_fewshot"]:
            raise ConfigError(f"task {task['name']} has no few-shot examples: drop num_fewshot={config['num_fewshot']}")
        fields = (task["problem"], task["answer"], *([task["id"]] if task["id"] else []))
        read_jsonl(data_file(task, config["data_dir"]), fields)

    def data_files(self, task: Mapping[str, Any], data_dir: str | Path | None) -> list[Path]:
        return [data_file(task, data_dir)]

    def evaluate(self, model: Any, tokenizer: Any, policy: Any, config: Mapping[str, Any]) -> Evaluation:
        """Solutions to the first ``limit`` problems, ``batch_size`` at a time, scored and set beside the full
        cache's (see the module)."""
        import torch

        from h2o_eval import generation

        task, settings = config["task"], config["generation"]
        problems = read_problems(config)
        seeds = [config["seed"] + s for s in range(settings["samples"] if settings["sample"] else 1)]
        log = generation.GenerationLog(max_new_tokens=task["max_new_tokens"])
        outputs: list[dict[str, Any]] = []
        with generation.Progress(len(problems) * len(seeds), f"solving {task['name']}", "solution") as progress:
            for sample, seed in enumerate(seeds):
                if settings["sample"]:
                    torch.manual_seed(seed)
                for row, (problem, generated) in enumerate(
                    solve(model, tokenizer, policy, config, problems, log, progress)
                ):
                    tokens = generated.pop("tokens")
                    prediction = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                    answer = str(problem[task["answer"]])
                    outputs.append({
                        "id": problem[task["id"]] if task["id"] else row,
                        **({"sample": sample, "seed": seed} if settings["sample"] else {}),
                        "prediction": prediction, "answer": answer, "final_answer": final_answer(task, prediction),
                        "scores": scores(task, prediction, answer), **generated, "token_ids": tokens,
                    })  # fmt: skip
        fields = {
            "metrics": {key: statistics.fmean(o["scores"][key] for o in outputs) for key in SCORES},
            "n_samples": len(outputs),
            **log.fields(),
        }
        lengths = [o["generated_tokens"] for o in outputs]
        for output in outputs:  # the length in tokens, read as a score: its mean, paired tests and plots per run
            output["scores"]["generated_tokens"] = float(output["generated_tokens"])
        fields["metric"] = "accuracy"
        fields["metrics"]["generated_tokens"] = statistics.fmean(lengths)
        fields["generation"] |= {
            "generated_tokens_median": statistics.median(lengths),
            "hit_max_new_tokens": statistics.fmean(length >= task["max_new_tokens"] for length in lengths),
        }
        if settings["sample"]:
            fields["generation"] |= {key: settings[key] for key in ("temperature", "top_p", "samples")}
            fields["generation"]["seeds"] = seeds
            fields["metrics"] |= pass_at_k(outputs, len(seeds))
        return Evaluation(fields, outputs)

    def reference(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """A greedy run is set beside the full cache's (:func:`full_config`); a sampled one beside none."""
        return None if config["generation"]["sample"] else full_config(config)

    def compare(
        self, model: Any, tokenizer: Any, config: Mapping[str, Any], evaluation: Evaluation, stored: list[dict] | None
    ) -> None:
        """The agreement with the full cache (see the module): its solutions from its record's outputs (``stored``,
        the same problems, the limit being identity; where they hold their tokens), from this run's own (the full
        cache's run), or generated once in this process."""
        outputs = evaluation.outputs
        if config["policy"]["name"] == "full":
            full = outputs
        elif stored is not None and all("token_ids" in row for row in stored):
            full = stored
        else:
            full = full_solutions(model, tokenizer, config)
        fields = evaluation.fields
        fields["metrics"]["agreement"], fields["generation"]["agreement"] = agreement(config["task"], outputs, full)


def solve(
    model: Any, tokenizer: Any, policy: Any, config: Mapping[str, Any], problems: list[dict], log: Any, progress: Any
) -> list[tuple[dict, dict[str, Any]]]:
    """Each problem with its generated ``tokens`` and the fields a run's outputs hold
    (:meth:`~h2o_eval.generation.GenerationLog.add`): ``batch_size`` problems at a time, each leaving its batch as its
    solution ends, greedy or sampled as ``generation.sample`` says."""
    from h2o_eval import generation
    from h2o_eval.policies import configured_interval
    from h2o_eval.runners.long_context import wrap

    task, settings = config["task"], config["generation"]
    prompts = [
        wrap(tokenizer, {"context": " ", "questions": [{"question": p[task["problem"]], "answer_prefix": ""}]})
        for p in problems
    ]
    sampling = generation.greedy(task["max_new_tokens"], tokenizer.pad_token_id)
    if settings["sample"]:
        sampling |= {"do_sample": True, "temperature": settings["temperature"], "top_p": settings["top_p"]}
    device, size, solved = next(model.parameters()).device, config["batch_size"], []
    for start in range(0, len(prompts), size):
        chunk = prompts[start : start + size]
        batch = generation.make_batch(
            [p.context_ids for p in chunk], [p.question_ids[0] for p in chunk], tokenizer.pad_token_id, device,
            split=config["protocol"] == "context",
        )  # fmt: skip
        generated = generation.run_batch(
            model, policy, batch, log, tokenizer, protocol=config["protocol"], kernels=config["kernels"],
            decoding=config["decoding"], graphs=config["graphs"], interval=configured_interval(config, policy),
            leaving=True, **sampling,
        )  # fmt: skip
        solved += [(problems[start + offset], row) for offset, row in enumerate(generated)]
        progress.update(len(generated))
    return solved


_FULL: dict[str, list[dict[str, Any]]] = {}  # the full cache's solutions generated in this process, by setting


def full_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's settings with the full cache in place of its policy (what the board's ``full`` runs with)."""
    return {**config, "policy": {"name": "full"}, "budget": 1.0, "decoding": "evict", "threshold": None}


def full_solutions(model: Any, tokenizer: Any, config: Mapping[str, Any]) -> list[dict]:
    """The full cache's greedy solutions to the run's problems (``final_answer`` and ``token_ids`` each), generated
    once in this process (a sweep's cells of one task share them)."""
    from h2o_eval import generation
    from h2o_eval.policies import Full

    reference, task = full_config(config), config["task"]
    key = json.dumps([reference[name] for name in ("model", "task", "limit", "protocol", "seed", "dtype")])
    if key not in _FULL:
        problems = read_problems(reference)
        log = generation.GenerationLog(max_new_tokens=task["max_new_tokens"])
        with generation.Progress(len(problems), f"the full cache's {task['name']}", "solution") as progress:
            solved = solve(model, tokenizer, Full(), reference, problems, log, progress)
        _FULL[key] = [
            {"final_answer": final_answer(task, tokenizer.decode(row["tokens"], skip_special_tokens=True).strip()),
             "token_ids": row["tokens"]}
            for _, row in solved
        ]  # fmt: skip
    return _FULL[key]


def agreement(task: Mapping[str, Any], outputs: list[dict], full: list[dict]) -> tuple[float, dict[str, float]]:
    """The share of problems whose final answer is the full cache's (each output's ``scores.agreement``), and
    ``generation.agreement``: the median position of the first token that departs from the full cache's trace, and
    the share of traces equal to it."""
    pairs = list(zip(outputs, full, strict=True))
    departures = [first_difference(o["token_ids"], f["token_ids"]) for o, f in pairs]
    for output, theirs in pairs:
        output["scores"]["agreement"] = float(output["final_answer"] == theirs["final_answer"])
    same = statistics.fmean(o["scores"]["agreement"] for o in outputs)
    return same, {
        "first_difference_median": statistics.median(departures),
        "same_trace": statistics.fmean(o["token_ids"] == f["token_ids"] for o, f in pairs),
    }


def pass_at_k(outputs: list[dict], samples: int) -> dict[str, float]:
    """pass@k under both scorers for every power of two k up to ``samples`` (:func:`pass_at`), mean over problems."""
    correct: dict[Any, list[float]] = {}
    for output in outputs:
        correct.setdefault(output["id"], []).append(output["scores"])
    metrics = {}
    for k in [2**i for i in range(samples.bit_length())]:
        for score in ("accuracy", "math_verify"):
            metrics[f"{score}_pass@{k}"] = statistics.fmean(
                pass_at(samples, int(sum(s[score] for s in rows)), k) for rows in correct.values()
            )
    return metrics


RUNNER = ReasoningRunner()
