"""How the reasoning runner asks a problem (``task.prompt``, ``task.instruction``).

- ``chat`` (the default): as kvpress's evaluation asks MATH-500 and AIME 2025 (``evaluation/evaluate.py`` with its
  pipeline, kvpress 0.5.5): a context of one space and the problem as the question, in the model's chat template
  (``enable_thinking=False``), no answer prefix.
- ``gsm8k_cot`` and ``minerva_math``: the chain-of-thought exemplars lm-eval ships for GSM8K (``gsm8k-cot.yaml``: 8
  questions, ``Q: ...\\nA: ...``, "The answer is N.") and for MATH (``minerva_math/utils.py``: 4 problems,
  ``Problem:\\n...\\n\\nSolution: ...``, a boxed answer and "Final Answer: The final answer is ..."), read from the
  installed lm-eval and laid out as lm-eval lays out a few-shot prompt (exemplars joined by a blank line, target
  after a space), as plain text after the tokenizer's beginning of sequence: for a base model, which a chat template
  does not suit. Generation stops, as lm-eval's does, at the task's stop strings (``Q:``; ``Problem:``), which the
  prediction then leaves out.

``task.instruction=boxed`` appends "Hold Onto That Thought"'s request for a boxed answer (Liu et al. 2025,
arXiv:2512.12008; its code's ``gsm8k_prompt`` and ``math500_prompt``, github.com/minghui-liu/kvpress,
``reason/gsm8k.py`` and ``reason/math500.py``) to the problem. The paper's code sends the problem and the instruction as
raw text; here they go into the prompt the task's ``prompt`` makes (the chat template by default).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h2o_eval.errors import ConfigError

PROMPTS = ("chat", "gsm8k_cot", "minerva_math")
INSTRUCTIONS = {"boxed": '\nSolve the problem step by step. Wrap your final answer in "\\boxed{}".'}
STOPS = {"chat": (), "gsm8k_cot": ("Q:",), "minerva_math": ("Problem:",)}


@dataclass(frozen=True)
class Asked:
    """A problem as the model is given it: the prompt's tokens, its context (kvpress's one space in the chat
    template, or the exemplars) then its question, and the strings at which its solution ends."""

    context: list[int]
    question: list[int]
    stops: tuple[str, ...]


def check(task: Mapping[str, Any]) -> None:
    """Refuse an unknown ``task.prompt`` or ``task.instruction`` in one line."""
    if task["prompt"] not in PROMPTS:
        raise ConfigError(f"task.prompt={task['prompt']!r}: use one of {', '.join(PROMPTS)}")
    if task["instruction"] is not None and task["instruction"] not in INSTRUCTIONS:
        raise ConfigError(f"task.instruction={task['instruction']!r}: use null or one of {', '.join(INSTRUCTIONS)}")


def ask(tokenizer: Any, task: Mapping[str, Any], problem: str) -> Asked:
    """``problem`` as the task's ``prompt`` and ``instruction`` ask it."""
    from h2o_eval.runners.long_context import wrap

    text = problem + INSTRUCTIONS.get(task["instruction"], "")
    if task["prompt"] == "chat":
        wrapped = wrap(tokenizer, {"context": " ", "questions": [{"question": text, "answer_prefix": ""}]})
        return Asked(wrapped.context_ids, wrapped.question_ids[0], ())
    shots, question = exemplars(task["prompt"])
    context = (tokenizer.bos_token or "") + "".join(f"{q}{a}\n\n" for q, a in shots)
    encoded = [tokenizer.encode(part, add_special_tokens=False) for part in (context, question.format(problem=text))]
    return Asked(*encoded, STOPS[task["prompt"]])


def cut(prediction: str, stops: Sequence[str]) -> str:
    """A prediction up to the first of ``stops`` in it, stripped (lm-eval's ``until``)."""
    for stop in stops:
        prediction = prediction.split(stop)[0]
    return prediction.strip()


@functools.cache
def exemplars(prompt: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """lm-eval's exemplars of ``prompt``, each as (its question, its target after a space), and the question's
    template (``{problem}``)."""
    import lm_eval
    import yaml

    tasks = Path(lm_eval.__file__).parent / "tasks"
    if prompt == "gsm8k_cot":
        config = yaml.safe_load((tasks / "gsm8k" / "gsm8k-cot.yaml").read_text())
        samples = config["fewshot_config"]["samples"]
        return tuple((f"Q: {s['question']}\nA:", f" {s['target']}") for s in samples), "Q: {problem}\nA:"
    shots = tuple((f"Problem:\n{s['problem']}\n\nSolution:", f" {s['solution']}") for s in minerva_samples(tasks))
    return shots, "Problem:\n{problem}\n\nSolution:"


def minerva_samples(tasks: Path) -> list[dict[str, str]]:
    """``list_fewshot_samples()`` of lm-eval's ``minerva_math/utils.py``, read from its source: importing the module
    asserts antlr4 4.11, and Hydra needs 4.9."""
    source = (tasks / "minerva_math" / "utils.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "list_fewshot_samples":
            returned = next(statement for statement in node.body if isinstance(statement, ast.Return))
            return ast.literal_eval(returned.value)
    raise RuntimeError(f"{tasks / 'minerva_math' / 'utils.py'} defines no list_fewshot_samples")
