"""The one-question leaderboard's cost, estimated from records (``benchmarks.costs --leaderboard``)."""

from __future__ import annotations

import math

import pytest
import test_plot

from h2o_eval import results
from h2o_eval.benchmarks.costs import cell, leaderboard_estimate, parts, parts_estimate, preset_cells
from h2o_eval.policies import make_policy

CELLS = preset_cells("kv_leaderboard")[2]


def write(folder, task, cells, contexts, questions, context_cost, question_cost, policy="h2o", budget=0.5):
    """``cells`` records of one task, each answering ``contexts`` contexts and ``questions`` questions in
    contexts x c + questions x q seconds."""
    for number in range(cells):
        record = test_plot.fake_record(task, policy, budget, 0.0, protocol="context")
        seconds = contexts * context_cost + questions * question_cost
        record |= {"n_documents": contexts, "n_questions": questions, "wall_seconds": seconds}
        results.write_record(folder / f"{task}_{policy}_{budget}_{number}.json", record)


def test_a_tasks_context_and_question_costs_come_from_its_two_protocols_and_carry_to_the_others(tmp_path):
    shared, one = tmp_path / "shared", tmp_path / "one"
    write(shared, "niah_single_2", 3, 10, 40, context_cost=20.0, question_cost=5.0)
    write(one, "niah_single_2", 2, 40, 40, context_cost=20.0, question_cost=5.0)
    write(shared, "vt", 3, 10, 40, context_cost=20.0, question_cost=9.0)  # shared records only
    write(shared, "cwe", 3, 40, 40, context_cost=20.0, question_cost=30.0)  # one question per context already
    estimate = leaderboard_estimate(shared, one, "tiny-llama", 40, CELLS)
    rows = {task: (source, seconds) for task, source, seconds in estimate}
    assert rows["niah_single_2"] == ("both protocols", pytest.approx(40 * 25.0))
    assert rows["vt"] == ("shared records, mean context cost", pytest.approx(40 * 29.0))
    assert rows["cwe"] == ("one question per context", pytest.approx(40 * 50.0))
    assert rows["qa_1"][0] == "no records" and math.isnan(rows["qa_1"][1])


def test_only_the_presets_cells_count(tmp_path):
    """kv_leaderboard sweeps 16 policies at 4 ratios, the full cache one record at every ratio: 61 cells per task.
    Records of other cells (a harder ratio, a score threshold at budget 1.0, a policy outside the preset) change
    nothing, however much they cost."""
    policies, budgets, cells = preset_cells("kv_leaderboard")
    assert (len(policies), len(budgets), len(cells)) == (16, 4, 61)
    h2o = make_policy("h2o").describe()
    assert cell(make_policy("full").describe(), 1.0) in cells and cell(h2o, 0.125) in cells
    assert cell(h2o, 0.0625) not in cells
    kvpress = [make_policy("adakv", base=base, **extra).describe() for base, extra in
               (("expected_attention", {"epsilon": 0.01}), ("compactor", {}))]  # fmt: skip
    assert all(cell(params, 0.5) in cells for params in kvpress)  # two board entries, one policy name
    assert cell(make_policy("snapkv").describe(), 0.5) not in cells  # the preset's snapkv is kvpress's
    shared, one = tmp_path / "shared", tmp_path / "one"
    write(shared, "niah_single_2", 3, 10, 40, context_cost=20.0, question_cost=5.0)
    write(one, "niah_single_2", 3, 40, 40, context_cost=20.0, question_cost=5.0, policy="full", budget=1.0)
    before = leaderboard_estimate(shared, one, "tiny-llama", 40, cells)[1]
    for policy, budget in (("h2o", 0.0625), ("knorm", 1.0), ("finch", 0.5)):
        write(one, "niah_single_2", 2, 40, 40, 200.0, 50.0, policy=policy, budget=budget)
    assert leaderboard_estimate(shared, one, "tiny-llama", 40, cells)[1] == before
    assert before == ("niah_single_2", "both protocols", pytest.approx(40 * 25.0))


def test_the_parts_of_a_cells_cpu_time_per_context_come_from_its_records(tmp_path):
    """Two cells run together on 4 contexts: per context and cell, each part's mean, the rest of the evaluation's
    CPU time, and the load's share (one load for both cells)."""
    for number, (prompt, decoding) in enumerate(((4.0, 8.0), (4.0, 16.0))):
        record = test_plot.fake_record("niah_single_2", "h2o", 0.5, 0.0, protocol="context")
        split = {"prompt": prompt, "scoring": 0.0, "question": 2.0, "decoding": decoding}
        record |= {"n_documents": 4, "cpu_seconds": 40.0, "load_cpu_seconds": 16.0}
        record["generation"] = {"cpu_seconds": split, "shared_prompt_cells": 2}
        results.write_record(tmp_path / f"r{number}.json", record)
    [(task, model, cells, each)] = parts(tmp_path)
    assert (task, model, cells) == ("niah_single_2", "tiny-llama", 2)
    assert each == {"prompt": 1.0, "scoring": 0.0, "question": 0.5, "decoding": 3.0, "rest": 5.5, "load": 2.0}


def test_the_boards_estimate_from_parts_takes_each_tasks_answer_length(tmp_path):
    """Two cells measured on 2 contexts: prompt, scoring and question (20 s) per context as measured, decoding at
    0.5 s a token (2 s for 4 tokens); a task whose records answer in 10 tokens costs 10 + 0.5 x 10 x 2 per context,
    a task without records the measured length."""
    measured, answers = tmp_path / "measured", tmp_path / "answers"
    for number in range(2):
        record = test_plot.fake_record("niah_single_2", "h2o", 0.5, 0.0, protocol="context")
        split = {"prompt": 6.0, "scoring": 2.0, "question": 2.0, "decoding": 2.0}
        record |= {"n_documents": 2, "n_questions": 2, "cpu_seconds": 12.0, "load_cpu_seconds": 1.0}
        record["generation"] = {"cpu_seconds": split, "generated_tokens_mean": 2.0}
        results.write_record(measured / f"m{number}.json", record)
    answered = test_plot.fake_record("vt", "h2o", 0.5, 0.0, protocol="context")
    answered["generation"] = {"generated_tokens_mean": 10.0}
    results.write_record(answers / "a.json", answered)
    rows = {task: (length, seconds) for task, length, seconds in parts_estimate(measured, [answers], "tiny-llama", 4)}
    assert rows["vt"] == (10.0, pytest.approx(4 * (10.0 + 0.5 * 10 * 2)))
    assert rows["qa_1"] == (2.0, pytest.approx(4 * (10.0 + 0.5 * 2 * 2)))
