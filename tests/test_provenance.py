"""PROVENANCE.md: where a folder's records came from, per commit, read from the records themselves."""

from __future__ import annotations

import pytest
from fake_records import fake_record

from h2o_eval import plot, results


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
