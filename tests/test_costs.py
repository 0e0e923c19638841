"""The one-question leaderboard's cost, estimated from records (``benchmarks.costs --leaderboard``)."""

from __future__ import annotations

import math

import pytest
import test_plot

from h2o_eval import results
from h2o_eval.benchmarks.costs import leaderboard_estimate, preset_cells, scaled_to_cells


def write(folder, task, cells, contexts, questions, context_cost, question_cost):
    """``cells`` records of one task whose wall seconds add up to contexts x c + questions x q."""
    total = contexts * context_cost + questions * question_cost
    for cell in range(cells):
        record = test_plot.fake_record(task, "h2o", 0.5, 0.0, protocol="context")
        record |= {"n_documents": contexts, "n_questions": questions, "wall_seconds": total / cells}
        results.write_record(folder / f"{task}_{cell}.json", record)


def test_a_tasks_context_and_question_costs_come_from_its_two_protocols_and_carry_to_the_others(tmp_path):
    shared, one = tmp_path / "shared", tmp_path / "one"
    write(shared, "niah_single_2", 3, 10, 40, context_cost=20.0, question_cost=5.0)
    write(one, "niah_single_2", 3, 40, 40, context_cost=20.0, question_cost=5.0)
    write(shared, "vt", 3, 10, 40, context_cost=20.0, question_cost=9.0)  # shared records only
    write(shared, "cwe", 3, 40, 40, context_cost=20.0, question_cost=30.0)  # one question per context already
    rows = {task: (source, seconds) for task, source, seconds in leaderboard_estimate(shared, one, "tiny-llama", 40)}
    assert rows["niah_single_2"] == ("both protocols", pytest.approx(40 * 25.0))
    assert rows["vt"] == ("shared records, mean context cost", pytest.approx(40 * 29.0))
    assert rows["cwe"] == ("one question per context", pytest.approx(40 * 50.0))
    assert rows["qa_1"][0] == "no records" and math.isnan(rows["qa_1"][1])


def test_the_estimate_scales_each_task_to_the_presets_cells(tmp_path):
    """kv_leaderboard sweeps 16 policies at 4 ratios: the full cache is one record at every ratio, so 61 cells per
    task; a task whose records hold 3 cells costs 61/3 of its estimate."""
    assert preset_cells("kv_leaderboard") == (16, 4, 61)
    shared, one = tmp_path / "shared", tmp_path / "one"
    write(shared, "niah_single_2", 3, 10, 40, context_cost=20.0, question_cost=5.0)
    write(one, "niah_single_2", 3, 40, 40, context_cost=20.0, question_cost=5.0)
    write(shared, "vt", 2, 10, 40, context_cost=20.0, question_cost=9.0)
    rows = leaderboard_estimate(shared, one, "tiny-llama", 40)
    assert scaled_to_cells(rows, shared, one, "tiny-llama", 61) == pytest.approx(
        40 * 25.0 * 61 / 3 + 40 * 29.0 * 61 / 2
    )
