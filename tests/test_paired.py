"""Paired verdicts: each run against the full cache (or another policy) document by document, on records written
here."""

from __future__ import annotations

import pytest
from fake_records import fake_record, long_record
from matplotlib.collections import PathCollection

from h2o_eval import plot, results
from h2o_eval.reports import figures, paired, tables


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
