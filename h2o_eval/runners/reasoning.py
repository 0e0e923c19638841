"""The ``reasoning`` runner: MATH-500, AIME 2024/2025 and GSM8K, where the cache grows with a long answer and
decode-time eviction (``decoding=evict``, ``interval``, a ``threshold``) matters most.

Each problem is asked as ``task.prompt`` says (:mod:`~h2o_eval.runners.math_prompts`: kvpress's chat prompt by
default, or lm-eval's chain-of-thought exemplars), with ``task.instruction=boxed`` asking for a boxed answer, and
solved greedily up to the task's ``max_new_tokens``. Scores per problem:

- ``accuracy``: kvpress's scorer (``evaluation/benchmarks/{math500,aime25}/calculate_metrics.py``), the text after
  the first (MATH-500) or last (AIME) ``boxed{`` up to the next ``}``, equal as a string to the answer; GSM8K's is
  the number of the last box, else the last number of the answer (lm-eval's ``gsm8k`` flexible-extract), equal to
  the number after the reference's ``####`` (commas, ``$`` and a final ``.`` dropped, as lm-eval compares them);
- ``math_verify``: math-verify's ``verify`` of the answer parsed from the prediction against the reference, which
  takes equal values written differently (``\\frac12`` and ``0.5``) and nested braces;
- the solution's class, one of :data:`CLASSES` (:func:`classify`): ``blank`` (nothing but whitespace), ``loop`` (it
  ran to the token limit repeating one n-gram), ``cut`` (it ran to the limit otherwise), ``answered`` (it ended
  with a final answer: a box, or GSM8K's number) or ``unanswered`` (it ended without one);
- ``evicted``: whether the cache let a token go (every row says how many, ``evicted_tokens``, per KV head, and from
  which generated token, ``evicted_from``; ``evicted_before_answer``: whether that was at or before the token that
  completed the final answer).

Problems decode ``batch_size`` at a time, each leaving its batch as its solution ends
(:func:`~h2o_eval.generation.run_batch` with ``leaving``). Greedy by default; ``generation.sample=true`` draws
``generation.samples`` solutions per problem (``temperature``, ``top_p``), the ``s``-th of every problem after
``torch.manual_seed(seed + s)``: the scores are their means (pass@1), with pass@k (:func:`pass_at`) for every power
of two k up to the samples, and the record names the seeds.

Agreement with the full cache (greedy runs, :func:`agreement`): the full cache's solutions to the same problems are
read from its record in ``results_dir`` (the run's settings with ``policy=full``, ``decoding=evict``, no
threshold), or generated once per process where there is none. Only problems where the full cache wrote a real
solution (not blank, not a loop) are compared: ``same_trace`` (the same tokens) and ``first_departure`` (the first
generated token that differs), and where that solution has a final answer, ``agreement`` (the same final answer):
each a per-problem score, with its count ``<score>_n``. Pairs both blank or both loops, and the problems left out,
are counted in ``generation.agreement``; none counts as agreement.
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
from h2o_eval.runners import Evaluation, Runner, math_prompts

SCORERS = ("first_boxed", "last_boxed", "gsm8k")
CLASSES = ("answered", "unanswered", "blank", "loop", "cut")
SCORES = ("accuracy", "math_verify", *CLASSES, "evicted")
COMPARED = ("agreement", "same_trace", "first_departure")  # set beside the full cache's solutions
NUMBER = re.compile(r"-?[$0-9.,]{2,}|-?[0-9]+")  # lm-eval gsm8k's flexible-extract: the last number
LOOP_SPAN, LOOP_GRAM = 64, 32  # a loop: the last 64 tokens one n-gram of at most 32 repeated
MINERVA = re.compile(r"Final Answer: The final answer is (.*?)\. I hope it is correct")  # lm-eval's minerva_math


def kvpress_boxed(prediction: str, answer: Any, last: bool) -> bool:
    """kvpress's ``score_aime``: the text after the first (``last``: the last) ``boxed{`` up to the next ``}``, equal
    as a string to ``str(answer)``; no ``boxed{`` is wrong."""
    found = boxed(prediction, last)
    return found is not None and found == str(answer)


def boxed(prediction: str, last: bool) -> str | None:
    """The text after the first (``last``: the last) ``boxed{`` up to the next ``}``, or None without one."""
    found = boxed_span(prediction, last)
    return None if found is None else prediction[found[0] : found[1]]


def boxed_span(prediction: str, last: bool) -> tuple[int, int] | None:
    """Where :func:`boxed`'s text is in ``prediction`` (start and end offsets), or None."""
    start = prediction.rfind("boxed{") if last else prediction.find("boxed{")
    if start < 0:
        return None
    start += len("boxed{")
    end = prediction.find("}", start)
    return start, len(prediction) if end < 0 else end


def final_answer(task: Mapping[str, Any], prediction: str) -> str | None:
    """The answer the task's accuracy scorer reads from a prediction: the boxed text, or GSM8K's number."""
    found = final_span(task, prediction)
    if found is None:
        return None
    text = prediction[found[0] : found[1]]
    return _plain(text) if task["scorer"] == "gsm8k" else text


def final_span(task: Mapping[str, Any], prediction: str) -> tuple[int, int] | None:
    """Where the final answer is in ``prediction`` (start and end offsets), or None: the boxed text (under
    ``task.prompt=minerva_math``, else the text its exemplars end on: "The final answer is X. I hope it is
    correct."); for GSM8K the last number in the last box, else the last number."""
    if task["scorer"] != "gsm8k":
        found = boxed_span(prediction, last=task["scorer"] == "last_boxed")
        if found is None and task.get("prompt") == "minerva_math" and (said := MINERVA.search(prediction)):
            return said.span(1)
        return found
    box = boxed_span(prediction, last=True)
    if box is not None and (numbers := list(NUMBER.finditer(prediction, *box))):
        return numbers[-1].span()
    numbers = list(NUMBER.finditer(prediction))
    return numbers[-1].span() if numbers else None


def classify(prediction: str, tokens: list[int], max_new_tokens: int, final: str | None) -> str:
    """The solution's class (:data:`CLASSES`): ``blank`` if its text is whitespace alone; at the token limit a
    ``loop`` where its last :data:`LOOP_SPAN` tokens repeat one n-gram of at most :data:`LOOP_GRAM` tokens (at least
    twice), else ``cut``; ended before it, ``answered`` with a final answer and ``unanswered`` without."""
    if not prediction.strip():
        return "blank"
    if len(tokens) >= max_new_tokens:
        return "loop" if repeating(tokens[-LOOP_SPAN:]) else "cut"
    return "answered" if final is not None else "unanswered"


def repeating(tail: list[int]) -> bool:
    """Whether ``tail`` is one n-gram (n at most :data:`LOOP_GRAM` and half its length) repeated to its end."""
    return any(
        all(tail[i] == tail[i - n] for i in range(n, len(tail))) for n in range(1, min(LOOP_GRAM, len(tail) // 2) + 1)
    )


def answer_token(tokenizer: Any, tokens: list[int], end: int) -> int:
    """The generated token that completes the text up to ``end`` (an offset in the tokens' decoded text): the first
    whose prefix decodes to at least ``end`` characters."""
    low, high = 0, len(tokens) - 1
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(tokens[: middle + 1], skip_special_tokens=True)) >= end:
            high = middle
        else:
            low = middle + 1
    return low


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
    """A prediction's ``accuracy`` and ``math_verify`` (see the module)."""
    if task["scorer"] == "gsm8k":
        reference = gsm8k_reference(answer)
        return {
            "accuracy": float(final_answer(task, prediction) == reference),
            "math_verify": float(math_verify(prediction, reference)),
        }
    return {
        "accuracy": float(kvpress_boxed(prediction, answer, last=task["scorer"] == "last_boxed")),
        "math_verify": float(math_verify(prediction, answer)),
    }


def read_problems(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The run's problems: the first ``limit`` of its task's file."""
    task = config["task"]
    path = data_file(task, config["data_dir"])
    problems = read_jsonl(path, (task["problem"], task["answer"]))
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
        math_prompts.check(task)
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
            raise ConfigError(
                f"task {task['name']} takes no num_fewshot={config['num_fewshot']}: its exemplars are task.prompt's "
                f"(one of {', '.join(math_prompts.PROMPTS)})"
            )
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
                    answer = str(problem[task["answer"]])
                    outputs.append({
                        "id": problem[task["id"]] if task["id"] else row,
                        **({"sample": sample, "seed": seed} if settings["sample"] else {}),
                        **solution(tokenizer, task, generated), "answer": answer,
                    })  # fmt: skip
                    outputs[-1]["scores"] |= scores(task, outputs[-1]["prediction"], answer)
        fields = {"metrics": means(outputs, SCORES), "n_samples": len(outputs), **log.fields()}
        lengths = [o["generated_tokens"] for o in outputs]
        for output in outputs:  # the length in tokens, read as a score: its mean, paired tests and plots per run
            output["scores"]["generated_tokens"] = float(output["generated_tokens"])
        fields["metric"] = "accuracy"
        fields["metrics"]["generated_tokens"] = statistics.fmean(lengths)
        before = [o["evicted_before_answer"] for o in outputs if o["evicted_before_answer"] is not None]
        fields["generation"] |= {
            "generated_tokens_median": statistics.median(lengths),
            "hit_max_new_tokens": statistics.fmean(length >= task["max_new_tokens"] for length in lengths),
            "evicted_tokens_mean": statistics.fmean(o["evicted_tokens"] for o in outputs),
            "evicted_before_answer": statistics.fmean(before) if before else None,
            "prompt": task["prompt"],
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
        """Set the solutions beside the full cache's (:func:`agreement`): its solutions from its record's outputs
        (``stored``, the same problems, the limit being identity; where they hold their tokens), from this run's own
        (the full cache's run), or generated once in this process."""
        outputs = evaluation.outputs
        if config["policy"]["name"] == "full":
            full = outputs
        elif stored is not None and all("token_ids" in row for row in stored):
            full = stored
        else:
            full = full_solutions(model, tokenizer, config)
        fields = evaluation.fields
        fields["generation"]["agreement"] = agreement(config["task"], outputs, full)
        fields["metrics"] |= means(outputs, COMPARED, counted=True)


def solution(tokenizer: Any, task: Mapping[str, Any], generated: dict[str, Any]) -> dict[str, Any]:
    """An output row of a solution (the fields :func:`solve` gives it, its ``tokens`` as ``token_ids``): the
    prediction (cut at the prompt's stop strings), its final answer and class, where the final answer was complete
    (``answer_token``) and whether the cache had let a token go by then, with the per-row scores of its class and
    eviction."""
    tokens = generated.pop("tokens")
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    stops = math_prompts.STOPS[task["prompt"]]
    prediction = math_prompts.cut(text, stops)
    final = final_answer(task, prediction)
    kind = classify(prediction, tokens, task["max_new_tokens"], final)
    shown = text.split(stops[0])[0] if stops else text
    span = final_span(task, shown)
    at = None if span is None else answer_token(tokenizer, tokens, span[1])
    evicted, since = generated["evicted_tokens"] > 0, generated["evicted_from"]
    # None: no answer, or an eviction whose start was not watched
    before = None if at is None or evicted and since is None else evicted and since <= at
    return {
        "prediction": prediction, "final_answer": final, "class": kind, "answer_token": at,
        "evicted_before_answer": before,
        "scores": {**{name: float(kind == name) for name in CLASSES}, "evicted": float(evicted)},
        **generated, "token_ids": tokens,
    }  # fmt: skip


def means(outputs: list[dict], names: tuple[str, ...], counted: bool = False) -> dict[str, float]:
    """The mean of each of ``names`` over the rows that hold it (a score None where it does not apply; a name no row
    holds is left out), and with ``counted`` the count of those rows as ``<name>_n``."""
    found = {}
    for name in names:
        values = [o["scores"][name] for o in outputs if o["scores"].get(name) is not None]
        if values:
            found[name] = statistics.fmean(values)
        if counted:
            found[f"{name}_n"] = len(values)
    return found


def solve(
    model: Any, tokenizer: Any, policy: Any, config: Mapping[str, Any], problems: list[dict], log: Any, progress: Any
) -> list[tuple[dict, dict[str, Any]]]:
    """Each problem with its generated ``tokens`` and the fields a run's outputs hold
    (:meth:`~h2o_eval.generation.GenerationLog.add`): ``batch_size`` problems at a time, each leaving its batch as its
    solution ends (at an end of sequence, or at the prompt's stop strings), greedy or sampled as
    ``generation.sample`` says; the cache watched for its first eviction (``evicted_from``)."""
    from h2o_eval import generation
    from h2o_eval.policies import configured_interval

    task, settings = config["task"], config["generation"]
    asked = [math_prompts.ask(tokenizer, task, p[task["problem"]]) for p in problems]
    sampling = generation.greedy(task["max_new_tokens"], tokenizer.pad_token_id)
    if settings["sample"]:
        sampling |= {"do_sample": True, "temperature": settings["temperature"], "top_p": settings["top_p"]}
    if stops := math_prompts.STOPS[task["prompt"]]:
        sampling["stop_strings"] = list(stops)
    device, size, solved = next(model.parameters()).device, config["batch_size"], []
    for start in range(0, len(asked), size):
        chunk = asked[start : start + size]
        batch = generation.make_batch(
            [a.context for a in chunk], [a.question for a in chunk], tokenizer.pad_token_id, device,
            split=config["protocol"] == "context",
        )  # fmt: skip
        generated = generation.run_batch(
            model, policy, batch, log, tokenizer, protocol=config["protocol"], kernels=config["kernels"],
            decoding=config["decoding"], graphs=config["graphs"], interval=configured_interval(config, policy),
            leaving=True, watch=True, **sampling,
        )  # fmt: skip
        solved += [(problems[start + offset], row) for offset, row in enumerate(generated)]
        progress.update(len(generated))
    return solved


_FULL: dict[str, list[dict[str, Any]]] = {}  # the full cache's solutions generated in this process, by setting


def full_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's settings with the full cache in place of its policy (what the board's ``full`` runs with)."""
    return {**config, "policy": {"name": "full"}, "budget": 1.0, "decoding": "evict", "threshold": None}


def full_solutions(model: Any, tokenizer: Any, config: Mapping[str, Any]) -> list[dict]:
    """The full cache's greedy solutions to the run's problems (``final_answer``, ``class`` and ``token_ids``
    each), generated once in this process (a sweep's cells of one task share them)."""
    from h2o_eval import generation
    from h2o_eval.policies import Full

    reference, task = full_config(config), config["task"]
    key = json.dumps([reference[name] for name in ("model", "task", "limit", "protocol", "seed", "dtype")])
    if key not in _FULL:
        problems = read_problems(reference)
        log = generation.GenerationLog(max_new_tokens=task["max_new_tokens"])
        with generation.Progress(len(problems), f"the full cache's {task['name']}", "solution") as progress:
            solved = solve(model, tokenizer, Full(), reference, problems, log, progress)
        _FULL[key] = [solution(tokenizer, task, row) for _, row in solved]
    return _FULL[key]


def agreement(task: Mapping[str, Any], outputs: list[dict], full: list[dict]) -> dict[str, Any]:
    """Set each output beside the full cache's solution to its problem: where that is a real solution (not
    ``blank``, not a ``loop``), the per-row scores ``same_trace`` and ``first_departure`` (:func:`first_difference`),
    and where it also holds a final answer, ``agreement`` (this solution's final answer is that one); elsewhere None,
    so that every policy is scored on the same problems. Returns ``generation.agreement``: the median first
    departure, and the pairs counted apart: both blank, both loops, the full cache's solution not real, or real
    without a final answer."""
    counts = dict.fromkeys(("both_blank", "both_loop", "full_not_real", "full_unanswered"), 0)
    departures = []
    for output, theirs in zip(outputs, full, strict=True):
        mine, own = output["class"], theirs.get("class") or full_class(task, theirs)
        if mine == own and mine in ("blank", "loop"):
            counts[f"both_{mine}"] += 1
        real = own not in ("blank", "loop")
        answered = real and theirs["final_answer"] is not None
        counts["full_not_real"] += not real
        counts["full_unanswered"] += real and not answered
        departure = first_difference(output["token_ids"], theirs["token_ids"])
        output["scores"] |= {
            "agreement": float(output["final_answer"] == theirs["final_answer"]) if answered else None,
            "same_trace": float(output["token_ids"] == theirs["token_ids"]) if real else None,
            "first_departure": float(departure) if real else None,
        }
        if real:
            departures.append(departure)
    return {"first_difference_median": statistics.median(departures) if departures else None, **counts}


def full_class(task: Mapping[str, Any], row: Mapping[str, Any]) -> str:
    """The class of a full-cache solution stored before solutions were classified (its prediction and tokens)."""
    return classify(row["prediction"], row["token_ids"], task["max_new_tokens"], row["final_answer"])


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
