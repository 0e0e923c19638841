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
"""

from __future__ import annotations

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
    parts = prediction.split("boxed{")
    if len(parts) < 2:
        return False
    return parts[-1 if last else 1].split("}")[0] == str(answer)


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


def data_file(task: Mapping[str, Any], data_dir: str | Path | None) -> Path:
    if data_dir is None:
        raise ConfigError(f"task={task['name']} reads {task['name']}/{task['split']}.jsonl: set data_dir to its folder")
    return split_file(data_dir, task["name"], task["split"])


class ReasoningRunner(Runner):
    """Generate a solution per problem and score its final answer."""

    name = "reasoning"

    def default_protocol(self, task: Mapping[str, Any]) -> str:
        return "prefill"

    def check(self, config: Mapping[str, Any]) -> None:
        task = config["task"]
        if task["scorer"] not in SCORERS:
            raise ConfigError(f"task.scorer={task['scorer']!r}: use one of {', '.join(SCORERS)}")
        value = task["max_new_tokens"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"task.max_new_tokens={value!r}: use an integer >= 1")
        if config["num_fewshot"]:
            raise ConfigError(f"task {task['name']} has no few-shot examples: drop num_fewshot={config['num_fewshot']}")
        fields = (task["problem"], task["answer"], *([task["id"]] if task["id"] else []))
        read_jsonl(data_file(task, config["data_dir"]), fields)

    def data_files(self, task: Mapping[str, Any], data_dir: str | Path | None) -> list[Path]:
        return [data_file(task, data_dir)]

    def evaluate(self, model: Any, tokenizer: Any, policy: Any, config: Mapping[str, Any]) -> Evaluation:
        """A greedy solution per problem (the first ``limit``), ``batch_size`` at a time, scored (see the module)."""
        from h2o_eval import generation
        from h2o_eval.policies import configured_interval
        from h2o_eval.runners.long_context import wrap

        task = config["task"]
        problems = read_jsonl(data_file(task, config["data_dir"]), (task["problem"], task["answer"]))
        problems = problems[: first(len(problems), config["limit"])]
        prompts = [
            wrap(tokenizer, {"context": " ", "questions": [{"question": p[task["problem"]], "answer_prefix": ""}]})
            for p in problems
        ]
        device = next(model.parameters()).device
        log = generation.GenerationLog(max_new_tokens=task["max_new_tokens"])
        outputs: list[dict[str, Any]] = []
        progress = generation.Progress(len(problems), f"solving {task['name']}", "problem")
        size = config["batch_size"]
        for start in range(0, len(prompts), size):
            chunk = prompts[start : start + size]
            batch = generation.make_batch(
                [p.context_ids for p in chunk], [p.question_ids[0] for p in chunk], tokenizer.pad_token_id, device,
                split=config["protocol"] == "context",
            )  # fmt: skip
            generated = generation.run_batch(
                model, policy, batch, log, tokenizer, protocol=config["protocol"], kernels=config["kernels"],
                decoding=config["decoding"], graphs=config["graphs"], interval=configured_interval(config, policy),
                **generation.greedy(task["max_new_tokens"], tokenizer.pad_token_id),
            )  # fmt: skip
            for offset, row in enumerate(generated):
                problem = problems[start + offset]
                prediction = tokenizer.decode(row.pop("tokens"), skip_special_tokens=True).strip()
                answer = str(problem[task["answer"]])
                outputs.append({
                    "id": problem[task["id"]] if task["id"] else start + offset, "prediction": prediction,
                    "answer": answer,
                    "scores": scores(task, prediction, answer), **row,
                })  # fmt: skip
            progress.update(len(generated))
        progress.close()
        n = max(len(outputs), 1)
        lengths = [o["generated_tokens"] for o in outputs]
        fields = {
            "metrics": {key: sum(o["scores"][key] for o in outputs) / n for key in SCORES},
            "n_samples": len(outputs),
            **log.fields(),
        }
        fields["generation"] |= {
            "generated_tokens_median": statistics.median(lengths) if lengths else 0,
            "hit_max_new_tokens": sum(length >= task["max_new_tokens"] for length in lengths) / n,
        }
        return Evaluation(fields, outputs)


RUNNER = ReasoningRunner()
