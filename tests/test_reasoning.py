"""The reasoning tasks (MATH-500, AIME 2024/2025, GSM8K): kvpress's scorers reproduced exactly, math-verify's second
score, GSM8K's numbers, and a run through the one generation path."""

from __future__ import annotations

import json

import pytest
from conftest import make_config

from h2o_eval.errors import ConfigError
from h2o_eval.run import execute, validate
from h2o_eval.runners.reasoning import gsm8k_prediction, gsm8k_reference, kvpress_boxed, math_verify, scores


def kvpress_math500(pred_answer, true_answer):
    """kvpress's evaluation/benchmarks/math500/calculate_metrics.py (8bb29b9), re-typed: its extract_boxed and
    score_aime."""
    try:
        extracted = str(pred_answer.split("boxed{")[1].split("}")[0])
    except IndexError:
        extracted = None
    return extracted == str(true_answer)


def kvpress_aime25(pred_answer, true_answer):
    """kvpress's evaluation/benchmarks/aime25/calculate_metrics.py (8bb29b9), re-typed: the last ``boxed{``."""
    try:
        extracted = str(pred_answer.split("boxed{")[-1].split("}")[0])
    except IndexError:
        extracted = None
    return extracted == str(true_answer)


OUTPUTS = [  # (prediction, answer): hand-picked where the scorers' rules show
    ("so the answer is $\\boxed{70}$.", "70"),
    ("so the answer is $\\boxed{ 70 }$.", "70"),
    ("first \\boxed{3}, then correcting myself \\boxed{70}", "70"),
    ("first \\boxed{70}, then \\boxed{3}", "70"),
    ("$\\boxed{\\frac{14}{3}}$", "\\frac{14}{3}"),
    ("$\\boxed{\\frac{14}", "\\frac{14"),
    ("The answer is 70.", "70"),
    ("", "70"),
    ("\\boxed{}", ""),
    ("\\boxed{70", "70"),
    ("fbox{70} and boxed{70}", 70),
]


@pytest.mark.parametrize(("prediction", "answer"), OUTPUTS)
def test_the_boxed_scorers_are_kvpress_s_math500_and_aime25_scorers(prediction, answer):
    assert kvpress_boxed(prediction, answer, last=False) == kvpress_math500(prediction, answer)
    assert kvpress_boxed(prediction, answer, last=True) == kvpress_aime25(prediction, answer)


def test_the_scorers_part_where_kvpress_s_string_match_cannot_see_equal_values():
    """kvpress's first-box scorer cuts a nested answer at its first ``}`` and compares strings; math-verify parses
    both and compares values."""
    task = {"scorer": "first_boxed"}
    answer = "\\left( 3, \\frac{\\pi}{2} \\right)"
    nested = scores(task, f"Hence $\\boxed{{{answer}}}$.", answer)
    assert nested == {"accuracy": 0.0, "math_verify": 1.0, "answered": 1.0}
    assert scores(task, "so $\\boxed{0.5}$", "\\frac{1}{2}") == {"accuracy": 0.0, "math_verify": 1.0, "answered": 1.0}
    assert scores(task, "so $\\boxed{4}$", "3") == {"accuracy": 0.0, "math_verify": 0.0, "answered": 1.0}
    assert scores(task, "so $\\boxed{3}$", "3") == {"accuracy": 1.0, "math_verify": 1.0, "answered": 1.0}
    assert not math_verify("no answer here", "3")


def test_gsm8k_compares_the_number_after_the_references_hashes_with_the_predictions_last_number():
    assert gsm8k_reference("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 1,018") == "1018"
    assert gsm8k_prediction("9 * 2 = 18, so she makes $1,018.") == "1018"
    assert gsm8k_prediction("no number") is None
    task = {"scorer": "gsm8k"}
    assert scores(task, "She makes $18.", "... #### 18") == {"accuracy": 1.0, "math_verify": 1.0, "answered": 1.0}
    assert scores(task, "18 eggs, then 20", "#### 18")["accuracy"] == 0.0
    assert scores(task, "I cannot tell", "#### 18") == {"accuracy": 0.0, "math_verify": 0.0, "answered": 0.0}


@pytest.mark.parametrize(("task", "rows"), [("math500", 500), ("aime24", 30), ("aime25", 30), ("gsm8k", 1319)])
def test_each_reasoning_task_reads_its_data_before_a_model_loads(data_dir, tmp_path, task, rows):
    spec = validate(make_config(data_dir, tmp_path, model="tiny-llama", task=task, policy="h2o", budget=256))
    assert spec.config["protocol"] == "prefill" and spec.runner.name == "reasoning"
    assert len(spec.runner.data_files(spec.config["task"], data_dir)) == 1
    assert sum(1 for _ in spec.runner.data_files(spec.config["task"], data_dir)[0].open()) == rows


def test_a_reasoning_task_is_refused_in_one_line_without_its_data_or_with_an_unknown_scorer(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="task=math500 reads math500/test.jsonl: set data_dir"):
        validate(make_config(None, tmp_path, model="tiny-llama", task="math500", policy="h2o"))
    with pytest.raises(ConfigError, match="task.scorer='exact': use one of first_boxed, last_boxed, gsm8k"):
        validate(make_config(data_dir, tmp_path, model="tiny-llama", task="math500", policy="h2o",
                             **{"task.scorer": "exact"}))  # fmt: skip
    with pytest.raises(ConfigError, match="no data file"):
        validate(make_config(tmp_path, tmp_path, model="tiny-llama", task="gsm8k", policy="h2o"))


def test_a_reasoning_run_records_both_scores_the_share_answered_and_the_generated_lengths(data_dir, tmp_path):
    """Three MATH-500 problems under H2O at a budget of 48 tokens, which the prompt and the solution share (the
    cache stays at 48 while the solution grows): each output scored, the record's means and lengths its outputs'."""
    config = make_config(data_dir, tmp_path, model="tiny-llama", task="math500", policy="h2o", budget=48, limit=3,
                         **{"task.max_new_tokens": 12})  # fmt: skip
    _, record = execute(validate(config))
    outputs = [json.loads(line) for line in (tmp_path / record["outputs"]).read_text().splitlines()]
    assert [o["id"] for o in outputs] == ["test/precalculus/807.json", "test/intermediate_algebra/1994.json",
                                          "test/algebra/2584.json"]  # fmt: skip
    for key in ("accuracy", "math_verify", "answered"):
        assert record["metrics"][key] == pytest.approx(sum(o["scores"][key] for o in outputs) / 3)
    lengths = sorted(o["generated_tokens"] for o in outputs)
    generation = record["generation"]
    assert generation["generated_tokens_median"] == lengths[1]
    assert generation["hit_max_new_tokens"] == pytest.approx(sum(n >= 12 for n in lengths) / 3)
    assert all(o["capacity"] <= 48 for o in outputs) and generation["kv_peak_entries"] <= 48
