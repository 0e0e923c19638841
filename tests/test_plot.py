"""Plots, tables and the notebook read result records; they are checked on records written here."""

from __future__ import annotations

import csv
import os

import pytest
from conftest import REPO
from fake_records import fake_record, long_record

from h2o_eval import plot, results
from h2o_eval.reports import figures, headline, paired, tables


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
