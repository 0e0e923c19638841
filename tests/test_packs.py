"""A board's records packed as one file: the tables, pairs and provenance read from the pack are those read from the
loose records; the store resumes beside a pack; pandas reads it as it is."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO

from h2o_eval import packs, plot, results, stats

BOARD = REPO / "results" / "ruler" / "records" / "scorers_gemma"  # 25 committed records: 9 policies, 3 budgets


def loose_board(folder):
    """The committed board written out as a run writes its records: one JSON file and its outputs each."""
    folder.mkdir()
    for name, entry in packs.entries(BOARD).items():
        results.write_record(folder / name, packs.record(entry))
        if "rows" in entry:
            results.write_jsonl(packs.outputs_path(folder / name), entry["rows"])
    return folder


def plotted(root, monkeypatch, *options):
    """Every file ``plot`` writes of ``root``/board, run from ``root`` (provenance names the folder as given)."""
    monkeypatch.chdir(root)
    out = root / ("provenance" if options else "plots")
    plot.main(["board", "--out", str(out), *options])
    return {path.relative_to(out): path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file()}


def test_a_packed_board_makes_the_tables_pairs_and_provenance_its_loose_records_make(tmp_path, monkeypatch):
    """Reference: ``plot`` (report, paired tests, headline; provenance) of a board as runs write it, a file per record
    and per outputs; implementation: the same board packed (``python -m h2o_eval.results pack``). Every file is byte
    for byte the same, and the loose files are gone."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    (tmp_path / "loose").mkdir()
    loose = loose_board(tmp_path / "loose" / "board")
    packed = tmp_path / "packed" / "board"
    shutil.copytree(loose, packed)
    before = [plotted(tmp_path / "loose", monkeypatch), plotted(tmp_path / "loose", monkeypatch, "--provenance")]
    done = subprocess.run(
        [sys.executable, "-m", "h2o_eval.results", "pack", str(packed)], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith(f"{packed / packs.PACK}: 25 records, ")
    assert [path.name for path in packed.iterdir()] == [packs.PACK]
    after = [plotted(tmp_path / "packed", monkeypatch), plotted(tmp_path / "packed", monkeypatch, "--provenance")]
    assert any(name.name.startswith("paired_") for name in after[0]) and after[1]
    for mine, theirs in zip(before, after, strict=True):
        assert mine == theirs


def test_a_pack_is_read_by_pandas_and_written_the_same_for_the_same_records(tmp_path):
    """pandas reads a pack as it is, a row per record with its settings, scores and per-question rows; packing the
    same records again gives the same bytes."""
    frame = pd.read_json(BOARD / packs.PACK, lines=True)
    assert len(frame) == 25 and {"full", "oracle", "kvzip"} <= set(frame["policy"]) and frame["file"].is_unique
    questions = frame.explode("rows")
    assert len(questions) == sum(frame["n_samples"]) and all("scores" in row for row in questions["rows"])
    again = loose_board(tmp_path / "again")
    results.pack(again)
    assert (again / packs.PACK).read_bytes() == (BOARD / packs.PACK).read_bytes()


def test_a_store_resumes_beside_its_pack_and_packing_again_folds_the_new_records_in(tmp_path):
    """A record in the pack is stored: a run of its setting finds it (skipped), under its own name or under another
    that ends in its hash, and its outputs; a record written after the pack is read beside it, a loose file over a
    packed one of its name; packing again holds both."""
    folder = loose_board(tmp_path / "board")
    names = sorted(packs.entries(BOARD))
    last = folder / names[-1]
    kept = json.loads(last.read_text())
    last.unlink()
    packs.outputs_path(last).unlink()
    results.pack(folder)
    first = folder / names[0]
    assert (
        results.stored(first) == first and results.read_record(first)["task"] == packs.entries(BOARD)[names[0]]["task"]
    )
    renamed = folder / ("other__" + names[0].rsplit("__", 1)[-1])
    assert results.stored(renamed) == first
    record = results.read_record(first)
    metric = stats.primary_metric(record)
    scores = stats.question_scores(record, folder, metric)
    assert scores and scores == stats.question_scores(record, BOARD, metric)
    assert results.stored(last) is None
    results.write_record(last, kept)
    results.write_jsonl(packs.outputs_path(last), packs.entries(BOARD)[names[-1]]["rows"])
    records, unreadable = results.read_records(folder)
    assert len(records) == 25 and not unreadable
    results.pack(folder)
    assert (folder / packs.PACK).read_bytes() == (BOARD / packs.PACK).read_bytes()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda folder: None, "no records in"),
        (lambda folder: (folder / "x.json").write_text("{"), "x.json is not valid JSON"),
        (
            lambda folder: (folder / "partial").mkdir() or (folder / "partial" / "a.json").write_text("{}"),
            "holds the answers of a unit stopped part way: finish the run first",
        ),
    ],
    ids=["empty", "unreadable", "unit-in-progress"],
)
def test_what_cannot_be_packed_is_refused_in_one_line_and_nothing_is_removed(tmp_path, make, message):
    folder = tmp_path / "board"
    folder.mkdir()
    make(folder)
    before = sorted(folder.rglob("*"))
    done = subprocess.run(
        [sys.executable, "-m", "h2o_eval.results", "pack", str(folder)], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line
    assert sorted(folder.rglob("*")) == before


def test_the_committed_boards_are_packed_and_the_checkout_is_code():
    """Every committed record is in its board's pack (no loose record or outputs file is tracked), and the tracked
    working tree is at most 25.5 MB (25 before the multi-turn board's 0.2 MB)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    files = [name for name in tracked.stdout.split("\0") if name]
    loose = [
        name for name in files if name.endswith(packs.OUTPUTS_SUFFIX) or "/records/" in name and name.endswith(".json")
    ]
    assert not loose, f"loose records tracked: {loose[:3]} (python -m h2o_eval.results pack their folder)"
    packed = [name for name in files if name.endswith(packs.PACK)]
    assert len(packed) >= 6
    for name in packed:
        with gzip.open(REPO / name, "rt") as handle:
            assert all(results.checked(json.loads(line), name) for line in handle)
    size = sum((REPO / name).stat().st_size for name in files if (REPO / name).is_file())
    assert size <= 25.5e6, f"the tracked tree is {size / 1e6:.1f} MB"
