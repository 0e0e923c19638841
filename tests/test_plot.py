"""Plots, tables and the notebook read result records; they are checked on records written here."""

from __future__ import annotations

import csv
import dataclasses
import os

import pytest
from conftest import REPO, record_settings
from matplotlib.collections import PathCollection

from h2o_eval import plot, results, stats
from h2o_eval.reports import figures, headline, leaderboards, paired, tables


def fake_record(
    task, policy, budget, value, created="2026-11-22T00:00:00+00:00", protocol="simulate", settings=None, **extra
):
    """A record of ``task`` run with ``policy`` at ``budget`` scoring ``value``; ``settings``: its config's
    overrides (``{"task.length": 1024}``)."""
    metric = "rouge2" if task == "xsum" else "acc"
    return {
        **record_settings(task, policy, budget, protocol, **(settings or {})),
        "task": task,
        "model": "tiny-llama",
        "policy": policy,
        "budget": budget,
        "protocol": protocol,
        "num_fewshot": 0,
        "limit": 10,
        "n_samples": 10,
        "created": created,
        "metrics": {metric: value, f"{metric}_stderr": 0.05, **extra},
    }


@pytest.fixture
def results_dir(tmp_path):
    records = [fake_record("copa", "full", 1.0, 0.7)]
    for budget, h2o, local in [(0.1, 0.6, 0.5), (0.2, 0.65, 0.55), (0.5, 0.7, 0.68)]:
        records += [fake_record("copa", "h2o", budget, h2o), fake_record("copa", "local", budget, local)]
    records += [fake_record("copa", "h2o", 0.2, 0.66, protocol="prefill"), fake_record("xsum", "h2o", 0.2, 0.04)]
    records += [fake_record("copa", "h2o", 0.1, 0.1, created="2026-11-21T00:00:00+00:00")]  # older rerun: dropped
    records += [fake_record("copa", "h2o", 16, 0.6)]  # a budget in tokens: a row, but no point on a % axis
    for number, record in enumerate(records):
        results.write_record(tmp_path / f"r{number}.json", record)
    return tmp_path


def test_table_keeps_the_newest_record_per_setting_and_the_primary_metric(results_dir):
    rows = tables.table(results.load_records(results_dir))
    copa_h2o = [
        (r["budget"], r["value"])
        for r in rows
        if r["task"] == "copa" and r["policy"] == "h2o" and r["protocol"] == "simulate"
    ]
    assert copa_h2o == [(0.1, 0.6), (0.2, 0.65), (0.5, 0.7), (16, 0.6)]
    assert [(r["metric"], r["value"]) for r in rows if r["task"] == "xsum"] == [("rouge2", 0.04)]
    assert len(rows) == 10
    assert tables.percent(16) == "16 tokens" and tables.percent(0.2) == "20%"
    drawn = [line.get_xdata() for line in figures.figure(rows, "copa").axes[0].lines if len(line.get_xdata()) > 2]
    assert drawn and all(max(xs) <= 100 for xs in drawn)


def test_budgets_in_tokens_are_drawn_on_an_axis_of_tokens_a_threshold_run_at_the_tokens_it_held(tmp_path):
    """The reasoning board's budgets count tokens (the prompt's and the generation's): its figures' x axis counts
    them, one line per policy across budgets, and a DMS run stands at the tokens it held."""
    records = [fake_record("gsm8k", "full", 1.0, 0.8)]
    records += [fake_record("gsm8k", "h2o", budget, value) for budget, value in ((128, 0.3), (256, 0.5), (512, 0.7))]
    dms = fake_record("gsm8k", "dms", 128, 0.6)
    dms["capacity"] = {"kept_fraction_mean": 0.4, "capacity_mean": 200.0}
    records.append(dms)
    for number, record in enumerate(records):
        results.write_record(tmp_path / f"r{number}.json", record)
    rows = tables.table(results.load_records(tmp_path))
    ax = figures.figure(rows, "gsm8k").axes[0]
    assert ax.get_xscale() == "log" and "tokens" in ax.get_xlabel()
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["128", "256", "512"]
    points = {tuple(line.get_xdata()) for line in ax.lines if line.get_label() != "full cache"}
    assert (128, 256, 512) in points and (200.0,) in points


def test_side_by_side_puts_each_policy_and_protocol_of_one_budget_beside_the_full_cache(results_dir, tmp_path):
    rows = tables.table(results.load_records(results_dir))
    lines = tables.side_by_side(rows, 0.2).splitlines()
    assert lines[2] == "| task | model | metric | n | full | h2o (prefill) | h2o (simulate) | local (simulate) |"
    assert "| copa | tiny-llama | acc | 10 | 0.700 ± 0.050 | 0.660 ± 0.050 | 0.650 ± 0.050 | 0.550 ± 0.050 |" in lines
    assert "| xsum | tiny-llama | rouge2 | 10 |  |  | 0.040 ± 0.050 |  |" in lines  # no full-cache xsum record
    plot.main([str(results_dir), "--out", str(tmp_path / "plots"), "--at", "0.1", "0.2"])
    assert (tmp_path / "plots" / "at_0.2.md").read_text() == tables.side_by_side(rows, 0.2)
    assert "0.600 ± 0.050" in (tmp_path / "plots" / "at_0.1.md").read_text()


def test_side_by_side_at_a_token_budget_names_a_task_setting_with_the_task_not_the_policy(tmp_path):
    """The reasoning board gives one model longer solutions (``task.max_new_tokens``): at a budget in tokens
    (``--at 128``, not 12,800 %), each policy is one column, and the task's setting names a row of its own."""
    longer = {"task.max_new_tokens": 1024}
    records = [fake_record("gsm8k", "full", 1.0, 0.8), fake_record("gsm8k", "h2o", 128, 0.3)]
    records += [fake_record("gsm8k", "tova", 128, 0.2), fake_record("gsm8k", "h2o", 256, 0.5)]
    records += [fake_record("gsm8k", "full", 1.0, 0.9, settings=longer)]
    records += [fake_record("gsm8k", "h2o", 128, 0.4, settings=longer)]
    for number, record in enumerate(records):
        results.write_record(tmp_path / f"r{number}.json", record)
    plot.main([str(tmp_path), "--out", str(tmp_path / "plots"), "--at", "128"])
    lines = (tmp_path / "plots" / "at_128.md").read_text().splitlines()
    assert lines[0] == "Budget 128 tokens:"
    assert lines[2] == "| task | model | metric | n | full | h2o (simulate) | tova (simulate) |"
    assert "| gsm8k | tiny-llama | acc | 10 | 0.800 ± 0.050 | 0.300 ± 0.050 | 0.200 ± 0.050 |" in lines
    assert "| gsm8k (task.max_new_tokens=1024) | tiny-llama | acc | 10 | 0.900 ± 0.050 | 0.400 ± 0.050 |  |" in lines


def test_cli_writes_figures_csv_and_markdown(results_dir, tmp_path, capsys):
    out = tmp_path / "plots"
    plot.main([str(results_dir), "--task", "copa", "--out", str(out)])
    assert {p.name for p in out.iterdir()} == {"copa.png", "copa.pdf", "summary.csv", "summary.md"}
    assert (out / "copa.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (out / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["policy"], r["protocol"], r["budget"], r["value"]) for r in rows} >= {
        ("full", "simulate", "1.0", "0.7"),
        ("local", "simulate", "0.1", "0.5"),
        ("h2o", "prefill", "0.2", "0.66"),
    }
    markdown = (out / "summary.md").read_text()
    assert "| copa | tiny-llama | simulate | h2o | 20% | acc | 0.6500 ± 0.0500 | 10 | 0 | 10 |" in markdown
    assert "xsum" not in markdown and "| copa |" in capsys.readouterr().out


def test_tasks_named_as_hydra_lists_them_are_chosen_and_a_name_no_record_has_is_refused(results_dir, tmp_path, capsys):
    """``--task copa,xsum`` chooses both tasks as ``--task copa xsum`` does; a misspelt name beside a right one is
    refused in one line naming the tasks there are, instead of plotting the right one alone."""
    for number, tasks in enumerate((["copa,xsum"], ["copa", "xsum"])):
        plot.main([str(results_dir), "--task", *tasks, "--out", str(tmp_path / str(number))])
    assert (tmp_path / "0" / "summary.md").read_text() == (tmp_path / "1" / "summary.md").read_text()
    assert "| xsum |" in (tmp_path / "0" / "summary.md").read_text()
    capsys.readouterr()
    for option, names in (("--task", ["copa", "xsun"]), ("--model", ["tiny-lama"])):
        with pytest.raises(SystemExit):
            plot.main([str(results_dir), option, *names, "--out", str(tmp_path / "typo")])
        error = capsys.readouterr().err
        assert error == (
            f"error: no record in {results_dir} of {option} {names[-1]}: its tasks are copa, xsum, its models "
            "tiny-llama\n"
        )
    assert not (tmp_path / "typo").exists()


def test_regenerated_figures_are_the_same_bytes_on_another_day(results_dir, tmp_path, monkeypatch):
    drawn = {}
    for day, epoch in enumerate(("0", "86400")):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)  # the creation date matplotlib would write
        plot.main([str(results_dir), "--task", "copa", "--out", str(tmp_path / str(day))])
        drawn[day] = {name: (tmp_path / str(day) / name).read_bytes() for name in ("copa.png", "copa.pdf")}
    assert drawn[0] == drawn[1]


def test_summary_states_the_summed_and_the_elapsed_compute_of_its_records(tmp_path):
    runs = [
        ("copa", "full", 1.0, "2026-11-22T00:10:00+00:00", 600.0),
        ("copa", "h2o", 0.2, "2026-11-22T00:15:00+00:00", 120.0),
    ]
    for number, (task, policy, budget, created, seconds) in enumerate(runs):
        record = {**fake_record(task, policy, budget, 0.5, created=created), "wall_seconds": seconds}
        results.write_record(tmp_path / f"r{number}.json", record)
    plot.main([str(tmp_path), "--out", str(tmp_path / "plots")])
    assert (
        (tmp_path / "plots" / "summary.md")
        .read_text()
        .endswith(
            "Compute: 2 records, 720 s of run time summed (`wall_seconds`); they ran from 2026-11-22 00:00 to "
            "2026-11-22 00:15 UTC, 900 s elapsed.\n"
        )
    )


def test_cli_refuses_a_missing_results_dir(tmp_path):
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "nowhere")])


@pytest.mark.slow
def test_notebook_runs_on_a_results_directory(results_dir, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    long_record(results_dir, "vt", "full", 1.0, [[1]] * 4)
    long_record(results_dir, "vt", "h2o", 0.5, [[1]] * 3 + [[0]])

    notebook = nbformat.read(REPO / "notebooks" / "accuracy_vs_budget.ipynb", as_version=4)
    os.environ["H2O_EVAL_RESULTS"] = str(results_dir)
    try:
        NotebookClient(
            notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        del os.environ["H2O_EVAL_RESULTS"]
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "| copa | tiny-llama | simulate | h2o | 20% | acc | 0.6500 ± 0.0500 |" in text
    assert "| tiny-llama | context | 4096 | h2o | 50% | 75.0 [" in text  # the long-context headline
    assert "Leaderboard: tiny-llama, protocol context, 4096 tokens, 1 question per context, all documents." in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # copa, xsum, vt and the leaderboard


@pytest.mark.slow
def test_figures_go_to_the_sweeps_wandb_group(results_dir, tmp_path, monkeypatch):
    import wandb

    logged, real_init = {}, wandb.init

    def init(**kwargs):
        run = real_init(dir=str(tmp_path), **kwargs)
        real_log = run.log
        run.log = lambda data: (
            logged.update(group=run.group, job_type=run.job_type, keys=sorted(data)) or real_log(data)
        )
        return run

    monkeypatch.setattr(wandb, "init", init)
    plot.main([str(results_dir), "--out", str(tmp_path / "plots"), "--wandb-group", "sweep-7"])
    assert logged == {"group": "sweep-7", "job_type": "plot", "keys": ["figures/copa", "figures/xsum", "summary"]}


def test_plot_skips_a_truncated_record_and_a_foreign_json_naming_them(results_dir, tmp_path, capsys):
    (results_dir / "truncated.json").write_text('{"task": "copa", "metr')
    (results_dir / "foreign.json").write_text('{"foo": 1}')
    plot.main([str(results_dir), "--out", str(tmp_path / "plots")])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert f"warning: skipped {results_dir / 'foreign.json'} is not a record (no model, task" in warnings[0]
    assert warnings[1].startswith(f"warning: skipped {results_dir / 'truncated.json'} is not valid JSON")
    assert len(warnings) == 2
    assert (tmp_path / "plots" / "summary.md").read_text() == tables.markdown(
        tables.table(results.load_records(results_dir))
    )


def test_records_of_different_limits_are_never_one_line(tmp_path, capsys):
    for number, (limit, budget, value) in enumerate([(10, 0.1, 0.5), (10, 0.2, 0.6), (50, 0.2, 0.7), (50, 0.5, 0.8)]):
        results.write_record(
            tmp_path / f"r{number}.json", {**fake_record("copa", "h2o", budget, value), "limit": limit}
        )
    results.write_record(tmp_path / "full.json", {**fake_record("copa", "full", 1.0, 0.9), "limit": None})
    rows = tables.table(results.load_records(tmp_path))
    figure = figures.figure(rows, "copa")
    handles, labels = figure.axes[0].get_legend_handles_labels()
    lines = {
        label: list(zip(*handle.lines[0].get_data(), strict=True))  # an errorbar: its data line
        for handle, label in zip(handles, labels, strict=True)
        if label.startswith("h2o")
    }
    assert len(lines) == 2 and "tiny-llama, all documents: full cache" in labels
    assert figure.axes[0].get_title() == "copa: tiny-llama, limit=10, limit=50 and all documents"
    assert lines["h2o – tiny-llama, limit=10"] == [(10.0, 0.5), (20.0, 0.6)]
    assert lines["h2o – tiny-llama, limit=50"] == [(20.0, 0.7), (50.0, 0.8)]
    table = tables.side_by_side(rows, 0.2)
    assert "| copa | tiny-llama (limit=10) | acc | 10 |  | 0.600 ± 0.050 |" in table
    assert "| copa | tiny-llama (limit=50) | acc | 10 |  | 0.700 ± 0.050 |" in table
    assert "| copa | tiny-llama (all documents) | acc | 10 | 0.900 ± 0.050 |  |" in table
    plot.main([str(tmp_path), "--out", str(tmp_path / "plots")])
    assert "note: copa has records of limit=10, limit=50, all documents: they are drawn and tabled apart" in (
        capsys.readouterr().err
    )


def test_a_figure_title_names_the_models_and_the_documents_its_records_were_scored_on(results_dir):
    """A new user saw a figure titled "copa": without the model and the documents (the ``limit``) its numbers
    cannot be read, nor told from another run's."""
    rows = tables.table(results.load_records(results_dir))
    assert figures.figure(rows, "copa").axes[0].get_title() == "copa: tiny-llama, limit=10"
    other = {**fake_record("copa", "h2o", 0.2, 0.7), "model": "smollm2-135m", "limit": None}
    rows = tables.table([fake_record("copa", "h2o", 0.2, 0.6), other])
    assert figures.figure(rows, "copa").axes[0].get_title().replace("\n", " ") == (
        "copa: smollm2-135m and tiny-llama, limit=10 and all documents"
    )


def paired_record(folder, name, task, policy, budget, outcomes, protocol="simulate", ids=None, limit=None):
    """A record with per-document 0/1 ``acc`` outcomes in its outputs file."""
    ids = ids or list(range(len(outcomes)))
    results.write_jsonl(
        folder / f"{name}.outputs.jsonl",
        [{"id": i, "scores": {"acc": float(o)}} for i, o in zip(ids, outcomes, strict=True)],
    )
    record = fake_record(task, policy, budget, sum(outcomes) / len(outcomes), protocol=protocol)
    results.write_record(folder / f"{name}.json", {**record, "limit": limit, "outputs": f"{name}.outputs.jsonl"})


@pytest.fixture
def paired_dir(tmp_path):
    right = [1] * 30 + [0] * 10  # full cache: 30 of 40
    paired_record(tmp_path, "copa-full", "copa", "full", 1.0, right)
    paired_record(tmp_path, "copa-h2o", "copa", "h2o", 0.2, right[:-2] + [1, 1])  # 2 more right: not significant
    paired_record(tmp_path, "copa-local", "copa", "local", 0.2, [0] * 20 + right[20:])  # 20 fewer: significant
    paired_record(tmp_path, "piqa-full", "piqa", "full", 1.0, [1, 0] * 10, protocol="prefill")
    paired_record(tmp_path, "piqa-h2o", "piqa", "h2o", 0.2, [1, 0] * 10)
    paired_record(tmp_path, "piqa-local", "piqa", "local", 0.2, [0, 0] * 10)
    paired_record(tmp_path, "piqa-tova", "piqa", "tova", 0.2, [1] * 20, ids=list(range(100, 120)))  # other documents
    tova = {**fake_record("copa", "tova", 0.2, 0.7), "limit": None}  # no per-document scores
    results.write_record(tmp_path / "copa-tova.json", tova)
    return tmp_path


def test_paired_rows_compare_each_run_with_the_full_cache_document_by_document(paired_dir):
    rows = tables.table(results.load_records(paired_dir))
    compared = {(r["task"], r["policy"]): r for r in paired.paired_rows(rows, paired_dir)}
    assert set(compared) == {
        ("copa", "h2o"),
        ("copa", "local"),
        ("piqa", "h2o"),  # against piqa's full cache of another protocol: the full cache holds everything in any
        ("piqa", "local"),
        ("mean of 2 tasks", "h2o"),
        ("mean of 2 tasks", "local"),
    }  # tova is left out twice: other documents, and no per-document scores
    h2o, local = compared["copa", "h2o"]["paired"], compared["copa", "local"]["paired"]
    assert h2o.difference == pytest.approx(2 / 40) and h2o.test.p == pytest.approx(1 / 4)  # 2 discordant pairs
    assert not h2o.significant and h2o.test.name == "McNemar mid-p"
    assert local.difference == pytest.approx(-20 / 40) and local.test.p == pytest.approx(1 / 2**20)
    assert local.significant
    piqa_local = compared["piqa", "local"]["paired"]
    mean = compared["mean of 2 tasks", "local"]
    assert mean["paired"].difference == pytest.approx((local.difference + piqa_local.difference) / 2)
    assert mean["paired"].low < mean["paired"].difference < mean["paired"].high


def test_no_mean_over_tasks_when_a_task_was_scored_on_two_limits(paired_dir, capsys):
    """PIQA rerun on more documents beside its first run: a mean over tasks would count PIQA twice."""
    paired_record(paired_dir, "piqa40-full", "piqa", "full", 1.0, [1] * 40, limit=40)
    paired_record(paired_dir, "piqa40-local", "piqa", "local", 0.2, [0] * 40, limit=40)
    rows = tables.table(results.load_records(paired_dir))
    compared = {(r["task"], r["policy"], r["limit"]) for r in paired.paired_rows(rows, paired_dir)}
    assert ("piqa", "local", 40) in compared and ("piqa", "local", None) in compared
    assert ("mean of 2 tasks", "h2o", None) in compared  # h2o's tasks are each scored once
    assert not any(task.startswith("mean") and policy == "local" for task, policy, _ in compared)
    assert "no mean over tasks for tiny-llama local simulate at 20%: piqa scored on several limits" in (
        capsys.readouterr().err
    )


def test_against_a_policy_pairs_the_same_budget_and_protocol(paired_dir):
    rows = tables.table(results.load_records(paired_dir))
    compared = {(r["task"], r["policy"]): r for r in paired.paired_rows(rows, paired_dir, against="local")}
    assert set(compared) == {("copa", "h2o"), ("piqa", "h2o"), ("mean of 2 tasks", "h2o")}
    assert compared["copa", "h2o"]["paired"].difference == pytest.approx(22 / 40)
    assert compared["copa", "h2o"]["baseline"] == pytest.approx(10 / 40)


def test_the_paired_table_and_the_rings_mark_only_significant_differences(paired_dir, tmp_path):
    plot.main([str(paired_dir), "--out", str(tmp_path / "plots")])
    table = (tmp_path / "plots" / "paired_full.md").read_text().splitlines()
    copa = {line.split(" | ")[3]: line for line in table if line.startswith("| copa ")}
    assert copa["local"].startswith(
        "| copa | tiny-llama | simulate | local | 20% | acc | 40 | 40 | 0.250 | 0.750 | -0.500 ["
    )
    assert copa["local"].endswith("] | 9.54e-07 * | McNemar mid-p |")  # the verdict follows p
    assert copa["h2o"].endswith("] | 0.25 (too few documents differ for p < 0.05) | McNemar mid-p |")
    assert "**Primary test (the verdict): p**" in table[0] and "McNemar" in table[0]
    assert not any("omitted" in line for line in table)  # one question per document: McNemar is valid
    rows = tables.table(results.load_records(paired_dir))
    significant = paired.significant_settings(paired.paired_rows(rows, paired_dir))
    figure = figures.figure(rows, "copa", significant)
    rings = [c for c in figure.axes[0].collections if isinstance(c, PathCollection) and len(c.get_offsets())]
    ringed = [c.get_offsets().tolist() for c in rings]
    assert ringed == [[[20.0, 0.25]]]  # local at 20 %, 10 of 40 right
    assert "differs from full (p < 0.05)" in [t.get_text() for t in figure.axes[0].get_legend().get_texts()]


def test_a_long_context_task_is_compared_at_each_length_apart(tmp_path, capsys):
    """Records of one long-context task at two prompt lengths are two tasks: each policy is paired with the full
    cache of its own length (other documents), and ``--task niah_single_1`` selects both."""
    for length, full, h2o in [(1024, [1] * 12, [1] * 12), (2048, [1] * 12, [0] * 12)]:
        for policy, outcomes in (("full", full), ("h2o", h2o)):
            name = f"{policy}-{length}"
            results.write_jsonl(
                tmp_path / f"{name}.outputs.jsonl",
                [{"id": i, "scores": {"string_match_all": float(o)}} for i, o in enumerate(outcomes)],
            )
            record = fake_record(
                "niah_single_1", policy, 1.0 if policy == "full" else 0.25, 0.0, settings={"task.length": length}
            )
            record |= {"length": length, "limit": 12, "outputs": f"{name}.outputs.jsonl"}  # a record names no metric
            record["metrics"] = {"string_match_all": sum(outcomes) / 12}
            results.write_record(tmp_path / f"{name}.json", record)
    rows = tables.table(results.load_records(tmp_path))
    assert sorted({r["task"] for r in rows}) == ["niah_single_1@1024", "niah_single_1@2048"]
    compared = {r["task"]: r["paired"].difference for r in paired.paired_rows(rows, tmp_path) if "@" in r["task"]}
    assert compared == {"niah_single_1@1024": 0.0, "niah_single_1@2048": -1.0}
    plot.main([str(tmp_path), "--out", str(tmp_path / "plots"), "--task", "niah_single_1"])
    assert (tmp_path / "plots" / "niah_single_1@1024.png").is_file() and (
        tmp_path / "plots" / "niah_single_1@2048.png"
    ).is_file()


def test_cells_with_several_questions_per_document_are_tested_by_document_and_say_mcnemar_is_omitted(tmp_path):
    """Haystacks of four questions: a policy that loses whole documents is compared document by document."""
    for policy, budget, lost in (("full", 1.0, 0), ("h2o", 0.25, 6)):
        per_document = [[0.0] * 4] * lost + [[1.0] * 4] * (12 - lost)
        long_record(tmp_path, "niah_single_2", policy, budget, per_document)
    rows = tables.table(results.load_records(tmp_path))
    (compared,) = paired.paired_rows(rows, tmp_path)
    verdict = compared["paired"]
    assert (verdict.n, verdict.documents, verdict.difference) == (48, 12, -0.5)
    assert verdict.test.name == "sign-flip by document" and verdict.test.p == pytest.approx(2.0**-6)
    table = paired.paired_markdown([compared]).splitlines()
    assert any("McNemar's test is per question" in line and "omitted" in line for line in table)
    assert table[-1].startswith(
        "| niah_single_2@4096 | tiny-llama | context | h2o | 25% | string_match_all | 48 | 12 |"
    )
    assert table[-1].endswith(" | 0.0156 * | sign-flip by document |")


def long_record(
    folder, task, policy, budget, per_document, protocol="context", length=4096, metric=None, limit=None, settings=None,
    name=None,
):  # fmt: skip
    """A long-context record whose outputs hold each document's questions (``per_document``: a list of score
    lists), with ids "<document>/<question>" as a haystack of several questions writes them; ``settings``: its
    config's other overrides; ``name``: told apart from records of the same task, policy and budget."""
    metric = metric or ("string_match_part" if task.startswith("qa") else "string_match_all")
    outputs = [
        {"id": f"{d}/{q}", "document": d, "depth": 50.0, "scores": {metric: float(score)}}
        for d, scores in enumerate(per_document)
        for q, score in enumerate(scores)
    ]
    name = f"{task}_{policy}_{budget}_{protocol}_{length}" + (f"_{name}" if name is not None else "")
    results.write_jsonl(folder / f"{name}.outputs.jsonl", outputs)
    record = fake_record(
        task, policy, budget, 0.0, protocol=protocol, settings={"task.length": length, **(settings or {})}
    )
    record |= {"length": length, "limit": limit, "n_samples": len(outputs), "outputs": f"{name}.outputs.jsonl"}
    record["metrics"] = {metric: sum(o["scores"][metric] for o in outputs) / len(outputs)}
    results.write_record(folder / f"{name}.json", record)


@pytest.fixture
def ruler_dir(tmp_path):
    """Two of RULER's tasks: niah_single_2 (two questions per haystack, 10 haystacks) and qa_1 (one question per
    document, string_match_part), with the full cache right everywhere and h2o losing whole documents."""
    long_record(tmp_path, "niah_single_2", "full", 1.0, [[1, 1]] * 10)
    long_record(tmp_path, "qa_1", "full", 1.0, [[1]] * 8)
    long_record(tmp_path, "niah_single_2", "h2o", 0.25, [[1, 1]] * 5 + [[0, 0]] * 5)
    long_record(tmp_path, "qa_1", "h2o", 0.25, [[1]] * 6 + [[0]] * 2)
    return tmp_path


def test_the_headline_is_each_tasks_score_and_their_unweighted_mean_with_document_intervals(ruler_dir, capsys):
    rows = tables.table(results.load_records(ruler_dir))
    assert {r["task"]: r["metric"] for r in rows} == {
        "niah_single_2@4096": "string_match_all",
        "qa_1@4096": "string_match_part",
    }
    full, h2o = headline.long_context(rows, ruler_dir)
    assert (full["policy"], h2o["policy"], h2o["budget"], h2o["length"]) == ("full", "h2o", 0.25, 4096)
    assert list(h2o["tasks"]) == ["niah_single_2", "qa_1"]  # RULER's order
    niah, qa = h2o["tasks"]["niah_single_2"], h2o["tasks"]["qa_1"]
    assert (niah.value, niah.n, niah.documents, qa.value) == (50.0, 20, 10, 75.0)
    # a haystack's two questions always agree here: resampled together they are one question per document
    assert niah == dataclasses.replace(stats.estimate([100.0] * 5 + [0.0] * 5), n=20)
    assert h2o["mean"].value == 62.5 and h2o["mean"].low < 62.5 < h2o["mean"].high
    assert (full["mean"].value, full["mean"].low, full["mean"].high) == (100.0, 100.0, 100.0)
    assert headline.tasks_label(h2o["tasks"]) == "2/13 tasks"
    assert headline.tasks_label(headline.RULER_TASKS) == "13 tasks"
    assert headline.tasks_label(["niah_single_2", "niah_single"]) == "2 tasks (1/13 of RULER's)"
    plot.main([str(ruler_dir), "--out", str(ruler_dir / "plots")])
    printed = capsys.readouterr().out
    written = (ruler_dir / "plots" / "headline.md").read_text()
    assert written in printed
    mean = h2o["mean"]
    assert (
        f"| tiny-llama | context | 4096 | h2o | 25% | 62.5 [{mean.low:.1f}, {mean.high:.1f}] | 2/13 tasks "
        f"| 50.0 [{niah.low:.1f}, {niah.high:.1f}] | 75.0 [{qa.low:.1f}, {qa.high:.1f}] |"
    ) in written


@pytest.fixture
def leaderboard_dir(tmp_path):
    long_record(tmp_path, "niah_single_2", "full", 1.0, [[1]] * 10)
    long_record(tmp_path, "vt", "full", 1.0, [[1]] * 10)
    for budget, oracle, h2o in [(0.75, 10, 8), (0.5, 9, 6), (0.25, 8, 3), (0.125, 6, 1)]:
        for task in ("niah_single_2", "vt"):
            long_record(tmp_path, task, "oracle", budget, [[1]] * oracle + [[0]] * (10 - oracle))
            long_record(tmp_path, task, "h2o", budget, [[1]] * h2o + [[0]] * (10 - h2o))
    long_record(tmp_path, "niah_single_2", "snapkv", 0.5, [[1]] * 7 + [[0]] * 3)  # one task only: vt left out
    long_record(tmp_path, "niah_single_2", "h2o", 0.5, [[1]] * 2 + [[0]] * 8, protocol="prefill")  # another table
    return tmp_path


def test_the_leaderboard_tables_each_policy_by_compression_ratio_the_ceilings_first(leaderboard_dir, capsys):
    out = leaderboard_dir / "plots"
    plot.main([str(leaderboard_dir), "--leaderboard", "--out", str(out)])
    stems = {"leaderboard_tiny-llama_context_4096", "leaderboard_tiny-llama_prefill_4096"}
    assert {path.name for path in out.iterdir()} == {f"{s}.{x}" for s in stems for x in ("md", "csv", "png", "pdf")}
    table = (out / "leaderboard_tiny-llama_context_4096.md").read_text()
    assert table in capsys.readouterr().out
    lines = table.splitlines()
    assert (
        "Tasks: 2/13 tasks (niah_single_2, vt). Not on this board, short of its tasks: snapkv (ratio 0.5)."
        in (lines[0])
    )
    assert lines[2] == "| policy | 0.25 | 0.5 | 0.75 | 0.875 |"
    assert [line.split(" | ")[0] for line in lines[4:]] == ["| full (ceiling)", "| oracle (not deployable)", "| h2o"]
    assert lines[4] == "| full (ceiling) | " + " | ".join(["100.0 [100.0, 100.0]"] * 4) + " |"
    h2o = lines[6].split(" | ")
    assert [cell.split(" [")[0] for cell in h2o[1:]] == ["80.0", "60.0", "30.0", "10.0"]
    assert h2o[2].endswith("]")
    with (out / "leaderboard_tiny-llama_context_4096.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["policy"], r["ratio"], r["score"], r["tasks"]) for r in rows[:3]] == [
        ("full", "0.0", "100.0", "2"),
        ("oracle", "0.25", "100.0", "2"),
        ("oracle", "0.5", "90.0", "2"),
    ]
    prefill = (out / "leaderboard_tiny-llama_prefill_4096.md").read_text().splitlines()
    assert prefill[4].startswith("| full (ceiling) | 100.0") and prefill[5].startswith("| h2o | 20.0 [")


def test_every_leaderboard_cell_is_a_mean_over_the_same_tasks_and_what_lacks_them_is_named(tmp_path):
    """The board's tasks are the task set whose table holds the most scores: a policy on one task fewer (a run
    under way) is named and left out, so that the rest keep their board; a policy on one task more is narrowed to
    the board's tasks, the task named. The headline keeps each setting's own tasks."""
    for task, full, h2o in (("niah_single_2", 10, 8), ("vt", 10, 2)):
        long_record(tmp_path, task, "full", 1.0, [[1]] * full + [[0]] * (10 - full))
        long_record(tmp_path, task, "h2o", 0.5, [[1]] * h2o + [[0]] * (10 - h2o))
        long_record(tmp_path, task, "tova", 0.5, [[1]] * 5 + [[0]] * 5)
    long_record(tmp_path, "niah_single_2", "snapkv", 0.5, [[1]] * 7 + [[0]] * 3)
    long_record(tmp_path, "niah_single_2", "snapkv", 0.25, [[1]] * 6 + [[0]] * 4)
    long_record(tmp_path, "qa_1", "h2o", 0.5, [[1]] * 10)
    out = tmp_path / "plots"

    def board():
        plot.main([str(tmp_path), "--leaderboard", "--out", str(out)])
        lines = (out / "leaderboard_tiny-llama_context_4096.md").read_text().splitlines()
        return lines[0], [line.split(" [")[0] for line in lines[4:]]

    title, rows = board()
    assert (
        "Tasks: 2/13 tasks (niah_single_2, vt). Left out, not in every cell: qa_1 (in 1 of 3 cells). Not on this "
        "board, short of its tasks: snapkv (ratios 0.5, 0.75)." in title
    )
    assert rows == ["| full (ceiling) | 100.0", "| h2o | 50.0", "| tova | 50.0"]
    with (out / "leaderboard_tiny-llama_context_4096.csv").open() as handle:
        assert {(row["policy"], row["score"], row["tasks"]) for row in csv.DictReader(handle)} == {
            ("full", "100.0", "2"),
            ("h2o", "50.0", "2"),
            ("tova", "50.0", "2"),
        }
    h2o = next(
        s for s in headline.long_context(tables.table(results.load_records(tmp_path)), tmp_path) if s["policy"] == "h2o"
    )
    assert (list(h2o["tasks"]), round(h2o["mean"].value, 1)) == (["niah_single_2", "vt", "qa_1"], 66.7)
    for path in tmp_path.glob("vt_tova_*"):
        path.unlink()  # two tasks of full and h2o (4 scores) against one task of full, h2o, tova, snapkv x2 (5)
    title, rows = board()
    assert (
        "Tasks: 1/13 tasks (niah_single_2). Left out, not in every cell: vt (in 2 of 5 cells), qa_1 (in 1 of 5 cells). "
        "full:" in title
    )
    assert rows == ["| full (ceiling) | 100.0", "| h2o | 80.0", "| snapkv | 70.0", "| tova | 50.0"]
    for path in tmp_path.glob("niah_single_2_full_*"):
        path.unlink()  # only the tasks the ceiling has: vt, whatever more the rest ran
    title, _ = board()
    assert (
        "Tasks: 1/13 tasks (vt). Left out, not in every cell: niah_single_2 (in 1 of 2 cells), qa_1 (in 1 of 2 "
        in title
    )
    assert "short of its tasks: snapkv (ratios 0.5, 0.75), tova (ratio 0.5). full:" in title


def test_tasks_scored_on_different_limits_share_one_leaderboard_and_a_task_on_two_limits_is_refused(tmp_path, capsys):
    """As the preset scores fwe on 4x the documents: one table per model, whose mean covers every task and whose
    title names each task's limit; a task scored on two limits of one model and length is refused in one line."""
    for policy, budget, niah, fwe in (("full", 1.0, 5, 20), ("h2o", 0.5, 3, 10)):
        long_record(tmp_path, "niah_single_1", policy, budget, [[1]] * niah + [[0]] * (5 - niah), limit=5)
        long_record(tmp_path, "fwe", policy, budget, [[1]] * fwe + [[0]] * (20 - fwe), limit=20)
    out = tmp_path / "plots"
    plot.main([str(tmp_path), "--leaderboard", "--out", str(out)])
    assert [path.name for path in out.glob("*.md")] == ["leaderboard_tiny-llama_context_4096.md"]
    lines = (out / "leaderboard_tiny-llama_context_4096.md").read_text().splitlines()
    assert lines[0].startswith(
        "Leaderboard: tiny-llama, protocol context, 4096 tokens, 1 question per context, limit=5; fwe: 20. "
    )
    assert "Tasks: 2/13 tasks (niah_single_1, fwe)" in lines[0]
    assert lines[5].startswith("| h2o | 55.0 [")  # (3/5 + 10/20) / 2
    with (out / "leaderboard_tiny-llama_context_4096.csv").open() as handle:
        assert {row["limits"] for row in csv.DictReader(handle)} == {"limit=5; fwe: 20"}
    assert headline.limits_label({"cwe": 20, "vt": 5, "niah_single_1": 5, "fwe": 20, "qa_2": None}) == (
        "limit=5; cwe, fwe: 20; qa_2: all documents"
    )
    long_record(tmp_path, "fwe", "h2o", 0.25, [[1]] * 10, limit=10)
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path), "--leaderboard", "--out", str(out)])
    refusal = "fwe of tiny-llama at 4096 tokens was scored on limit=10 and limit=20: give each limit's records a "
    assert capsys.readouterr().err.strip().endswith(refusal + "results dir of its own")
    plot.main([str(tmp_path), "--out", str(tmp_path / "all")])
    assert f"note: no long-context headline: {refusal}" in capsys.readouterr().err
    assert not (tmp_path / "all" / "headline.md").exists() and (tmp_path / "all" / "summary.md").is_file()


def test_the_leaderboard_figure_draws_score_against_compression_ratio_with_dashed_and_dotted_ceilings(
    leaderboard_dir,
):
    rows = tables.table(results.load_records(leaderboard_dir))
    groups = leaderboards.leaderboards(headline.long_context(rows, leaderboard_dir))
    key = ("tiny-llama", "context", 4096)
    ax = leaderboards.leaderboard_figure(key, groups[key]).axes[0]
    handles, labels = ax.get_legend_handles_labels()
    lines = dict(zip(labels, handles, strict=True))
    assert labels == ["full cache", "oracle (not deployable)", "h2o"]  # snapkv, on one of the two tasks, is not
    assert lines["full cache"].get_linestyle() == "--" and list(lines["full cache"].get_ydata()) == [100.0, 100.0]
    oracle, h2o = lines["oracle (not deployable)"].lines[0], lines["h2o"].lines[0]
    assert oracle.get_linestyle() == ":"
    assert list(h2o.get_xdata()) == [0.25, 0.5, 0.75, 0.875] and list(h2o.get_ydata()) == [80.0, 60.0, 30.0, 10.0]
    assert ax.get_xlabel() == "compression ratio (share of the context removed, 1 − budget)"
    assert ax.get_title().replace("\n", " ") == (
        "tiny-llama, protocol context, 4096 tokens, 1 question per context, all documents"
    )


def test_many_policies_at_hard_ratios_stay_apart_in_the_leaderboard_figure(tmp_path):
    """Twelve policies (more than the colour cycle) at 0.25, 0.9375 and 0.96875: the ratio axis is a logit scale
    on which 0.9375 and 0.96875 stand apart (a linear axis puts them 4 % of the way from 0.25 apart); lines that
    share a colour differ in marker; the lines at one ratio spread over at most figures.SPREAD points."""
    import matplotlib.pyplot as plt

    policies = ["h2o", "snapkv", "tova", "knorm", "streaming", "random", "keydiff", "expected_attention"]
    policies += ["pyramidkv", "lagkv", "cur", "leverage"]
    long_record(tmp_path, "vt", "full", 1.0, [[1]] * 4)
    for number, policy in enumerate(policies):
        for budget in (0.75, 0.0625, 0.03125):
            long_record(tmp_path, "vt", policy, budget, [[1]] * (number % 4) + [[0]] * (4 - number % 4))
    rows = tables.table(results.load_records(tmp_path))
    ((key, group),) = leaderboards.leaderboards(headline.long_context(rows, tmp_path)).items()
    ax = leaderboards.leaderboard_figure(key, group).axes[0]
    ax.figure.canvas.draw()
    assert ax.get_xscale() == "logit"
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["0.25", "0.9375", "0.96875"]
    x = [ax.transData.transform((ratio, 0))[0] for ratio in (0.25, 0.9375, 0.96875)]
    assert x[2] - x[1] > (x[1] - x[0]) / 8
    lines = [container.lines[0] for container in ax.containers]
    assert len(lines) == len(policies) and len({line.get_color() for line in lines}) < len(policies)
    assert len({(line.get_color(), line.get_marker()) for line in lines}) == len(policies)
    at_025 = [line.get_transform().transform((line.get_xdata()[0], 0))[0] for line in lines]
    assert max(at_025) - min(at_025) <= figures.SPREAD / 72 * ax.figure.dpi + 1e-6
    plt.close(ax.figure)


def test_cli_leaderboard_without_long_context_records_says_what_to_run(results_dir, capsys):
    with pytest.raises(SystemExit):
        plot.main([str(results_dir), "--leaderboard"])
    assert "no long-context records of a policy" in capsys.readouterr().err


def test_the_budget_axis_says_what_the_budget_is_a_share_of(results_dir, tmp_path):
    rows = tables.table(results.load_records(results_dir))
    assert figures.figure(rows, "xsum").axes[0].get_xlabel() == "KV cache budget (% of the sequence)"
    assert (
        figures.figure(rows, "copa").axes[0].get_xlabel()
        == "KV cache budget (% of the prompt for prefill, of the sequence for simulate)"
    )
    context = [fake_record("copa", "full", 1.0, 0.7), fake_record("copa", "h2o", 0.2, 0.6, protocol="context")]
    rows = tables.table(context)  # the full cache's protocol is not the budget's
    assert figures.figure(rows, "copa").axes[0].get_xlabel() == "KV cache budget (% of the context)"


def test_lines_at_one_budget_are_drawn_apart_and_the_oracle_is_dotted(results_dir):
    for budget, value in ((0.1, 0.69), (0.2, 0.7)):
        results.write_record(results_dir / f"oracle{budget}.json", fake_record("copa", "oracle", budget, value))
    rows = [r for r in tables.table(results.load_records(results_dir)) if r["protocol"] == "simulate"]
    ax = figures.figure(rows, "copa").axes[0]
    handles, labels = ax.get_legend_handles_labels()
    lines = dict(zip(labels, handles, strict=True))
    assert labels == ["full cache", "h2o", "local", "oracle (not deployable)"]
    assert lines["full cache"].get_linestyle() == "--"
    oracle, h2o, local = (lines[name].lines[0] for name in ("oracle (not deployable)", "h2o", "local"))
    assert oracle.get_linestyle() == ":" and h2o.get_linestyle() == "-"
    assert list(h2o.get_xdata()) == list(local.get_xdata()) == [10.0, 20.0, 50.0]  # the data keep their budgets
    h2o_x = h2o.get_transform().transform([(20.0, 0.65)])[0, 0]
    local_x = local.get_transform().transform([(20.0, 0.55)])[0, 0]
    assert 2 <= abs(h2o_x - local_x) <= 10  # drawn a few points apart
    low, high = ax.get_ylim()
    assert low < 0.5 - 0.05 and high > 0.7 + 0.05  # and inside the axes, error bars included


@pytest.fixture
def snapkv_settings_dir(tmp_path):
    """The full cache and three SnapKV settings at one budget: the defaults, ``decoding=grow`` and
    ``policy.window=8``, on one long-context task with per-question outputs."""
    long_record(tmp_path, "niah_single_1", "full", 1.0, [[1]] * 8)
    for name, settings in (("defaults", {}), ("grow", {"decoding": "grow"}), ("window", {"policy.window": 8})):
        long_record(tmp_path, "niah_single_1", "snapkv", 0.5, [[1]] * 6 + [[0]] * 2, settings=settings, name=name)
    return tmp_path


LABELS = {"snapkv", "snapkv (decoding=grow)", "snapkv (window=8)"}


def test_settings_that_differ_beyond_the_columns_are_rows_of_their_own_labelled_by_what_differs(
    snapkv_settings_dir, tmp_path, capsys
):
    rows = tables.table(results.load_records(snapkv_settings_dir))
    assert {r["policy"] for r in rows} == {"full", *LABELS}
    assert {r["policy"] for r in paired.paired_rows(rows, snapkv_settings_dir)} == LABELS
    assert {s["policy"] for s in headline.long_context(rows, snapkv_settings_dir)} == {"full", *LABELS}
    plot.main([str(snapkv_settings_dir), "--out", str(tmp_path / "plots")])
    summary = (tmp_path / "plots" / "summary.md").read_text()
    assert "Every row, where it applies: 1 question per context." in summary
    assert all(f"| {label} | 50% |" in summary for label in LABELS)
    assert all(f"| {label} | 50% |" in (tmp_path / "plots" / "headline.md").read_text() for label in LABELS)
    plot.main([str(snapkv_settings_dir), "--out", str(tmp_path / "board"), "--leaderboard"])
    board = next((tmp_path / "board").glob("leaderboard_*.md")).read_text()
    assert all(f"| {label} | " in board for label in LABELS)
    plot.main([str(snapkv_settings_dir), "--out", str(tmp_path / "needle"), "--needle"])
    capsys.readouterr()
    from h2o_eval import plot_needle

    assert {r["policy"] for r in plot_needle.needle_rows(rows, snapkv_settings_dir)} == {"full", *LABELS}


def test_questions_per_context_tell_rows_apart(tmp_path):
    for questions in (1, 2):
        settings = {"task.questions": questions}
        long_record(tmp_path, "niah_single_1", "h2o", 0.5, [[1] * questions] * 4, settings=settings, name=questions)
    rows = tables.table(results.load_records(tmp_path))
    assert {r["policy"] for r in rows} == {"h2o (1 question per context)", "h2o (2 questions per context)"}


def test_records_that_no_column_tells_apart_are_refused_naming_what_differs(tmp_path, capsys):
    for number, data in enumerate(("abc", "def")):
        results.write_record(tmp_path / f"r{number}.json", {**fake_record("copa", "h2o", 0.2, 0.5), "data": data})
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(tmp_path), "--out", str(tmp_path / "plots")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "differ in data" in err and "usage" not in err


def test_a_folder_of_nothing_readable_names_the_files_it_skipped_and_the_earlier_plot(results_dir, tmp_path, capsys):
    out = tmp_path / "plots"
    plot.main([str(results_dir), "--out", str(out)])
    for path in results_dir.glob("*.json"):
        path.write_text("{truncated")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(results_dir), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "usage" not in err
    assert err.startswith(f"error: no record in {results_dir} was readable: skipped {results_dir / 'r0.json'}")
    assert f"the figures in {out} are an earlier plot's" in err


def provenance_record(folder, name, commit, dirty, created, wall, threads=1, cpu=None, fields=None, **overrides):
    """A record of niah_single_1 at 4096 tokens computed at ``commit`` (``dirty``), ending at ``created`` after
    ``wall`` seconds (``cpu`` CPU seconds; None: a record older than them), under torch ``threads``, with the
    record's ``fields``; ``overrides``: its other settings."""
    record = fake_record(
        "niah_single_1", "h2o", 0.5, 0.5, created=created, protocol="context",
        settings={"task.length": 4096, "decoding": "grow", **overrides},
    )  # fmt: skip
    record |= (
        {
            "length": 4096,
            "git": {"commit": commit * 40, "dirty": dirty},
            "wall_seconds": wall,
            "load_seconds": 2.0,
            "threads": {"torch": threads, "blas": [threads], "numba": threads, "threads": threads},
            "versions": {"torch": "2.13.0+cpu", "transformers": "5.24.0", "lm_eval": "0.4.13"},
        }
        | ({} if cpu is None else {"cpu_seconds": cpu})
        | (fields or {})
    )
    results.write_record(folder / f"{name}.json", record)


def test_provenance_tells_per_commit_its_records_times_threads_and_versions_and_the_settings_shared_or_varying(
    tmp_path, capsys
):
    provenance_record(tmp_path, "a", "a", False, "2026-11-25T10:10:00+00:00", 600.0, cpu=550.0, **{"task.questions": 4})
    provenance_record(tmp_path, "b", "a", True, "2026-11-25T10:20:00+00:00", 300.0, threads=2, **{"task.questions": 4})
    provenance_record(
        tmp_path, "c", "b", False, "2026-11-25T12:00:00+00:00", 3600.0, cpu=3400.0, **{"task.questions": 1}
    )
    out = tmp_path / "tables"
    plot.main([str(tmp_path), "--provenance", "--out", str(out)])
    text = (out / "PROVENANCE.md").read_text()
    assert capsys.readouterr().out.strip() == str(out / "PROVENANCE.md")
    lines = text.splitlines()
    assert lines[0] == f"# Provenance of `{tmp_path}`"
    assert "3 records, computed at 2 commits (1 of them with a dirty tree" in text
    aaa, bbb, total = (
        next(line for line in lines if line.startswith(start)) for start in ("| aaa", "| bbb", "| **all")
    )
    assert aaa == (
        "| aaaaaaa | 2 | 1 | 2026-11-25 10:10 | 2026-11-25 10:20 | 900 s | 550 s (1 without) | 4 s | 1,200 s "
        "| 1 (1), 2 (1) "
        "| 2.13.0+cpu | 5.24.0 | 0.4.13 | tiny-llama |"
    )
    assert bbb == (
        "| bbbbbbb | 1 | 0 | 2026-11-25 12:00 | 2026-11-25 12:00 | 3,600 s (1.0 h) | 3,400 s | 2 s "
        "| 3,600 s (1.0 h) | 1 | 2.13.0+cpu | 5.24.0 | 0.4.13 | tiny-llama |"
    )
    assert total.startswith(
        "| **all** | 3 | 1 | 2026-11-25 10:10 | 2026-11-25 12:00 | 4,500 s (1.2 h) | 3,950 s (1.1 h) (1 without) | 6 s "
    )
    assert "| 7,200 s (2.0 h) | 1 (2), 2 (1) |" in total  # 10:00 (the first start) to 12:00
    assert "| aaaaaaa | tiny-llama | 2 | niah_single_1 | h2o | 0.5 |" in lines
    shared = lines[lines.index("Every record:") + 2 : lines.index("Varying, with the number of records of each value:")]
    assert {"- length: 4096", "- protocol: context", "- decoding=grow"} <= set(shared)
    assert "- task.questions: 4 questions per context (2), 1 question per context (1)" in lines
    plot.main([str(tmp_path), "--provenance", "--out", str(out)])
    assert (out / "PROVENANCE.md").read_text() == text  # regenerated from the same records: the same file


def test_provenance_names_the_commit_a_resumed_run_began_at_and_the_answers_it_took_up(tmp_path, capsys):
    """A run that took up a stopped run's answers (generation.resumed) computed them at the commit that run began
    at: the provenance says so, where it would otherwise credit the finishing commit with every answer."""
    resumed = {"answers": 29, "cpu_seconds": 147.5, "wall_seconds": 177.6, "git": {"commit": "c" * 40, "dirty": True}}
    fields = {"generation": {"resumed": resumed}}
    for name in ("a", "b"):
        provenance_record(tmp_path, name, "b", False, "2026-11-25T12:00:00+00:00", 60.0, cpu=50.0, fields=fields)
    out = tmp_path / "tables"
    plot.main([str(tmp_path), "--provenance", "--out", str(out)])
    lines = (out / "PROVENANCE.md").read_text().splitlines()
    assert lines[lines.index("## Resumed runs") + 6 :][:1] == ["| bbbbbbb | ccccccc (dirty) | 2 | 29 |"]
    provenance_record(tmp_path, "a", "b", False, "2026-11-25T12:00:00+00:00", 60.0, cpu=50.0)
    provenance_record(tmp_path, "b", "b", False, "2026-11-25T12:00:00+00:00", 60.0, cpu=50.0)
    plot.main([str(tmp_path), "--provenance", "--out", str(out)])
    assert "## Resumed runs" not in (out / "PROVENANCE.md").read_text()  # no record resumed: no section
    capsys.readouterr()


def test_provenance_of_a_folder_without_records_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(tmp_path), "--provenance", "--out", str(tmp_path / "tables")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "no records in" in err
    assert not (tmp_path / "tables" / "PROVENANCE.md").exists()


def test_a_leaderboard_whose_tasks_ask_different_questions_per_context_names_each_tasks_count_once(tmp_path, capsys):
    """As the shared-context preset asks four questions of each haystack but one of fwe's documents: one row per
    policy over both tasks, the counts named once in the title, the headline, the CSV and each task's figure."""
    for policy, budget, niah, fwe in (("full", 1.0, 5, 20), ("h2o", 0.5, 3, 10)):
        per_document = [[1] * 4] * niah + [[0] * 4] * (5 - niah)
        long_record(tmp_path, "niah_single_1", policy, budget, per_document, limit=5, settings={"task.questions": 4})
        per_document = [[1]] * fwe + [[0]] * (20 - fwe)
        long_record(tmp_path, "fwe", policy, budget, per_document, limit=20, settings={"task.questions": 1})
    board = tmp_path / "board"
    plot.main([str(tmp_path), "--leaderboard", "--out", str(board)])
    lines = (board / "leaderboard_tiny-llama_context_4096.md").read_text().splitlines()
    assert lines[0].startswith(
        "Leaderboard: tiny-llama, protocol context, 4096 tokens, 4 questions per context (fwe: 1), limit=5; fwe: 20. "
    )
    assert [line.split(" [")[0] for line in lines[4:]] == ["| full (ceiling) | 100.0", "| h2o | 55.0"]  # (3/5+10/20)/2
    with (board / "leaderboard_tiny-llama_context_4096.csv").open() as handle:
        assert {row["per_context"] for row in csv.DictReader(handle)} == {"4 questions per context (fwe: 1)"}
    out = tmp_path / "plots"
    plot.main([str(tmp_path), "--out", str(out)])
    capsys.readouterr()
    written = (out / "headline.md").read_text()
    assert "Every row: 4 questions per context (fwe: 1)." in written
    assert "| tiny-llama | context | 4096 | h2o | 50% | 55.0 [" in written  # one row over both tasks
    assert "| mean of 2 tasks | tiny-llama | context | h2o | 50% |" in (out / "paired_full.md").read_text()
    from matplotlib.image import imread

    assert imread(out / "fwe@4096.png").size  # drawn; its title and labels are checked below
    rows = tables.table(results.load_records(tmp_path))
    fig = figures.figure(rows, "fwe@4096")
    ax = fig.axes[0]
    assert ax.get_title() == "fwe@4096: tiny-llama, limit=20 (1 question per context)"
    assert {text.get_text() for text in ax.get_legend().get_texts()} == {"full cache", "h2o"}
