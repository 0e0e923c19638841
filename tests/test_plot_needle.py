"""The long-context pictures read records and their per-document outputs written here."""

from __future__ import annotations

import math

import pytest
import test_plot
from conftest import record_settings

from h2o_eval import plot, plot_needle, results
from h2o_eval.reports import tables


def needle_rows(folder):
    return plot_needle.needle_rows(tables.table(results.load_records(folder)), folder)


def write_run(
    folder,
    policy,
    budget,
    length,
    scores,
    created="2026-11-22T00:00:00+00:00",
    task="niah_single_1",
    metric="string_match_all",
):
    """A record and its outputs: ``scores`` maps each depth (None: no needle) to its documents' scores."""
    name = f"{task}_{policy}_{budget}_{length}_{created[:10]}"
    outputs = [{"depth": d, "scores": {metric: s}} for d, values in scores.items() for s in values]
    results.write_jsonl(folder / f"{name}.outputs.jsonl", outputs)
    record = {
        **record_settings(task, policy, budget, "prefill", **{"task.length": length}),
        "model": "tiny-llama",
        "task": task,
        "policy": policy,
        "budget": budget,
        "protocol": "prefill",
        "num_fewshot": 0,
        "limit": None,
        "length": length,
        "n_samples": len(outputs),
        "created": created,
        "metrics": {metric: sum(o["scores"][metric] for o in outputs) / len(outputs)},
        "outputs": f"{name}.outputs.jsonl",
    }
    results.write_record(folder / f"{name}.json", record)


@pytest.fixture
def results_dir(tmp_path):
    for length in (256, 512):
        write_run(tmp_path, "full", 1.0, length, {0: [1.0, 1.0], 50: [1.0, 1.0], 100: [1.0, 1.0]})
    write_run(tmp_path, "h2o", 0.2, 256, {0: [1.0, 1.0], 50: [1.0, 0.0], 100: [0.0, 0.0]})
    write_run(tmp_path, "h2o", 0.2, 512, {0: [1.0, 0.0], 50: [0.0, 0.0], 100: [0.0, 0.0]})
    write_run(tmp_path, "h2o", 0.2, 512, {0: [0.0, 0.0]}, created="2026-11-21T00:00:00+00:00")  # older: dropped
    write_run(tmp_path, "full", 1.0, 512, {None: [0.5, 0.7]}, task="cwe")
    return tmp_path


def test_rows_hold_each_depths_mean_score_from_the_outputs_of_the_newest_record(results_dir):
    rows = {(r["task"], r["policy"], r["length"]): r for r in needle_rows(results_dir)}
    assert len(rows) == 5
    assert rows["niah_single_1", "h2o", 256]["depths"] == {0: (1.0, 2), 50: (0.5, 2), 100: (0.0, 2)}
    assert rows["niah_single_1", "h2o", 512]["depths"] == {0: (0.5, 2), 50: (0.0, 2), 100: (0.0, 2)}
    assert rows["niah_single_1", "h2o", 512]["score"] == pytest.approx(1 / 6)
    assert rows["cwe", "full", 512]["depths"] == {}


def test_heatmap_puts_the_full_cache_first_and_colours_depth_by_length(results_dir):
    rows = [r for r in needle_rows(results_dir) if r["task"] == "niah_single_1"]
    fig = plot_needle.heatmap(rows)
    full, h2o = fig.axes[:2]
    assert full.get_title() == "full cache" and h2o.get_title() == "h2o 20% (prefill)"
    assert h2o.images[0].get_array().tolist() == [[1.0, 0.5], [0.5, 0.0], [0.0, 0.0]]  # depths 0/50/100 x 256/512
    assert [t.get_text() for t in h2o.get_xticklabels()] == ["256", "512"]


def test_cli_draws_heatmaps_and_length_lines_and_only_lines_without_needles(results_dir, tmp_path, capsys):
    out = tmp_path / "pictures"
    plot.main([str(results_dir), "--needle", "--out", str(out)])
    names = sorted(path.name for path in out.iterdir())
    assert names == [
        f"{kind}_{task}_tiny-llama.{suffix}"
        for kind, task in [("length", "cwe"), ("length", "niah_single_1"), ("needle", "niah_single_1")]
        for suffix in ("pdf", "png")
    ]
    assert str(out / "needle_niah_single_1_tiny-llama.png") in capsys.readouterr().out
    lines = plot_needle.length_plot([r for r in needle_rows(results_dir) if r["task"] == "niah_single_1"])
    full, h2o = lines.axes[0].get_lines()
    assert full.get_linestyle() == "--" and list(full.get_ydata()) == [1.0, 1.0]
    assert [math.isclose(a, b) for a, b in zip(h2o.get_ydata(), [0.5, 1 / 6], strict=True)] == [True, True]


def test_cli_needle_without_long_context_records_says_what_to_run(tmp_path, capsys):
    results.write_record(tmp_path / "copa.json", test_plot.fake_record("copa", "h2o", 0.2, 0.5))
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path), "--needle"])
    assert "no long-context records" in capsys.readouterr().err


def test_rulers_qa_tasks_are_drawn_on_their_own_metric(tmp_path):
    for length, score in ((2048, 0.75), (4096, 0.5)):
        write_run(tmp_path, "full", 1.0, length, {None: [score, score]}, task="qa_1", metric="string_match_part")
    (row, _) = needle_rows(tmp_path)
    assert (row["metric"], row["depths"]) == ("string_match_part", {})
    figure = plot_needle.length_plot(needle_rows(tmp_path))
    assert figure.axes[0].get_ylabel() == "string_match_part"
    assert list(figure.axes[0].get_lines()[0].get_ydata()) == [0.75, 0.5]
