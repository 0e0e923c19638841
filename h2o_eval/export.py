"""``python -m h2o_eval.export <the overrides of a run> out=FILE.jsonl``: the documents a long-context run would ask,
written without loading model weights (only the model's tokenizer), so that they can be read, diffed or shared.

    python -m h2o_eval.export model=smollm2-135m task=niah_single_2 limit=40 data_dir=../shared/data out=niah.jsonl

One JSON line per question (per document, for RULER's tasks, which ask one): ``task``, ``document`` (its index),
``question_index``, ``context``, ``question``, ``answer_prefix``, ``outputs`` (the references), ``depths`` (each
asked needle's depth in percent), ``tokens`` (the prompt's tokens in the model's tokenizer, chat template
included), ``context_tokens``, ``fit_tokens`` (RULER's measure of the input in the task's fit tokenizer) and
``fit_tokenizer``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from h2o_eval.errors import ConfigError


def rows(config: dict[str, Any], tokenizer: Any) -> list[dict[str, Any]]:
    """The lines of the export of a validated long-context ``config``."""
    from h2o_eval.runners.long_context import prompts

    task = config["task"]
    lines = []
    for prompt in prompts(tokenizer, config):
        document = prompt.document
        for k, question in enumerate(document["questions"]):
            lines.append(
                {
                    "task": task["name"],
                    "document": document["index"],
                    "question_index": k,
                    "context": document["context"],
                    "question": question["question"],
                    "answer_prefix": question["answer_prefix"],
                    "outputs": question["outputs"],
                    "depths": question["depths"],
                    "tokens": len(prompt.context_ids) + len(prompt.question_ids[k]),
                    "context_tokens": len(prompt.context_ids),
                    "fit_tokens": document["fit_tokens"],
                    "fit_tokenizer": task["fit_tokenizer"],
                }
            )
    return lines


def main(argv: list[str]) -> None:
    from h2o_eval.errors import fail
    from h2o_eval.grid import compose
    from h2o_eval.models import load_tokenizer
    from h2o_eval.results import write_jsonl
    from h2o_eval.run import validate
    from h2o_eval.runners import runner_of

    outs = [arg for arg in argv if arg.startswith("out=")]
    try:
        if len(outs) != 1:
            raise ConfigError("give the file to write as out=FILE.jsonl (once)")
        config = validate(compose([arg for arg in argv if not arg.startswith("out=")])).config
        if runner_of(config["task"]).name != "long_context":
            raise ConfigError(f"task {config['task']['name']} is not a long-context task: export writes those")
        lines = rows(config, load_tokenizer(config["model"]))
    except ConfigError as error:
        fail(error)
    path = Path(outs[0].removeprefix("out="))
    write_jsonl(path, lines)
    print(f"{len(lines)} questions of {config['task']['name']} -> {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
