"""The long-context headline and the leaderboards (tables and figures by compression ratio), on records written
here."""

from __future__ import annotations

import csv
import dataclasses

import pytest
from fake_records import long_record

from h2o_eval import plot, results, stats
from h2o_eval.reports import figures, headline, leaderboards, tables


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
