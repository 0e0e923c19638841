"""A grid stopped part way resumes from its last batch, on this machine or another, and writes the records an
unstopped one would."""

from __future__ import annotations

import json
import re

import pytest

from h2o_eval import generation, grid


class Stopped(BaseException):
    """A run ended from outside (a preempted job, a machine taken back), which nothing in the run catches."""


def test_a_stopped_grid_resumes_from_its_last_batch_and_writes_the_records_an_unstopped_one_would(
    data_dir, tmp_path, monkeypatch, capsys
):
    """Reference: a grid of cells under two protocols (8 batches of one document) run through; implementation: the
    same grid stopped after its 5th batch, then run again with its cells in another order and room for batches of 2,
    into another folder that the stopped run's ``partial/`` was moved to (another machine's checkout of committed
    records). The stopped run writes no record and leaves its answers under ``partial/``, as JSON; the second takes
    them up in their own batches of one, answers only the 3 batches left, says so, writes the records of the
    unstopped run (outputs, scores, capacities, generation fields but time), counts the first run's time, and removes
    the file after the records. A file cut short is started over, with a line that says so."""
    from h2o_eval.generation.partial import Partial

    monkeypatch.chdir(tmp_path)
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=600", "++task.max_new_tokens=6", "limit=4"]
    args += ["batch_size=1", f"data_dir={data_dir}", "wandb.mode=disabled", "budget=0.5"]
    args += ["protocol=context,prefill", "decoding=grow"]
    grid.main([*args, "policy=full,h2o,knorm", "results_dir=whole"])
    saves, save, finish, fitting = [], Partial.save, Partial.finish, generation.fitting_rows

    def stopping(self, *a, **k):
        save(self, *a, **k)
        saves.append(self.path)
        if len(saves) == stop:
            raise Stopped

    def finishing(self):
        assert len(list(self.path.parent.parent.glob("*.json"))) == 6, "the records should be written first"
        finish(self)

    monkeypatch.setattr(Partial, "save", stopping)
    monkeypatch.setattr(Partial, "finish", finishing)
    stop = 5  # the save after which the run stops
    with pytest.raises(Stopped):
        grid.main([*args, "policy=full,h2o,knorm", "results_dir=stopped"])
    assert not list((tmp_path / "stopped").glob("*.json")), "a stopped run should write no record"
    [kept] = (tmp_path / "stopped" / "partial").iterdir()
    assert kept.name == saves[0].name and len(json.loads(kept.read_text())["answers"]) == 6
    (tmp_path / "moved").mkdir()
    (tmp_path / "stopped" / "partial").rename(tmp_path / "moved" / "partial")
    stop = None
    capsys.readouterr()
    monkeypatch.setattr(generation, "fitting_rows", lambda asked, row_bytes, memory: 2)
    grid.main([*args, "policy=knorm,h2o,full", "results_dir=moved"])
    assert len(saves) == 8, "the second run should answer only the 3 batches the first did not"
    resumed = r"answering niah_single_1 x 6 cells: resumed from \S*moved/partial/\w+\.json, 15 of 24 answers kept"
    assert re.search(resumed, capsys.readouterr().err)
    assert not (tmp_path / "moved" / "partial").exists(), "the partial answers should go with the run, their folder too"
    assert not (tmp_path / "whole" / "partial").exists()

    def read(folder):
        records = {}
        for path in sorted((tmp_path / folder).glob("*.json")):
            record = json.loads(path.read_text())
            outputs = [json.loads(line) for line in (tmp_path / folder / record["outputs"]).read_text().splitlines()]
            records[path.name] = record, outputs
        return records

    whole, again = read("whole"), read("moved")
    assert sorted(whole) == sorted(again) and len(whole) == 6
    timing = ("cpu_seconds", "generated_tokens_per_s", "resumed")
    for name, (record, outputs) in whole.items():
        resumed, resumed_outputs = again[name]
        keys = ("id", "prediction", "scores", "capacity", "generated_tokens", "kv_entries")
        assert [[o[k] for k in keys] for o in resumed_outputs] == [[o[k] for k in keys] for o in outputs]
        assert resumed["metrics"] == record["metrics"] and resumed["capacity"] == record["capacity"]
        generated = {k: v for k, v in resumed["generation"].items() if k not in timing}
        assert generated == {k: v for k, v in record["generation"].items() if k not in timing}
        assert "resumed" not in record["generation"]
        earlier = resumed["generation"]["resumed"]
        assert earlier["answers"] == (4 if "context" in name else 1) and earlier["git"] == resumed["git"]
        assert resumed["cpu_seconds"] > earlier["cpu_seconds"] > 0
        assert resumed["wall_seconds"] > earlier["wall_seconds"] > 0

    stop = len(saves) + 5
    monkeypatch.setattr(generation, "fitting_rows", fitting)
    with pytest.raises(Stopped):
        grid.main([*args, "policy=full,h2o,knorm", "results_dir=cut"])
    [kept] = (tmp_path / "cut" / "partial").iterdir()
    kept.write_bytes(kept.read_bytes()[:100])
    stop = None
    capsys.readouterr()
    grid.main([*args, "policy=full,h2o,knorm", "results_dir=cut"])
    assert f"partial answers {kept} unreadable" in capsys.readouterr().err
    assert len(saves) == 8 + 5 + 8 and sorted(read("cut")) == sorted(whole)


def test_answers_kept_on_another_device_or_thread_count_or_as_a_pickle_are_started_over(tmp_path, capsys):
    """device=auto and an unset thread count resolve differently on different machines, and either may change an
    answer's rounding: a run takes up the answers of a stopped run made as it is made, and starts over, in one line,
    those made on another device or with other threads, and a file an older h2o_eval pickled (never unpickled: it
    could run code), which it removes."""
    from h2o_eval.generation.partial import Partial

    path, names, cpu = tmp_path / "partial" / "a.json", ["r1.json", "r2.json"], {"device": "cpu", "threads": 1}

    def kept(made):
        Partial(path, names, made=cpu).save(1, {("context", 0)}, [["a"], ["b"]])
        return Partial(path, list(reversed(names)), made=made).load(1)

    earlier = kept(dict(cpu))
    assert earlier.answers == [["b"], ["a"]] and earlier.batches == {("context", 0)}
    assert capsys.readouterr().err == ""
    assert kept({"device": "cuda:0", "threads": 1}) is None
    assert kept({"device": "cpu", "threads": 2}) is None
    pickled = path.with_suffix(".pkl")
    pickled.write_bytes(b"not to be unpickled")
    path.unlink()
    assert Partial(path, names, made=cpu).load(1) is None and not pickled.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"partial answers {path} answered with cpu, 1 thread, and this run has cuda:0, 1 thread: starting over",
        f"partial answers {path} answered with cpu, 1 thread, and this run has cpu, 2 threads: starting over",
        f"partial answers {pickled} kept by an older h2o_eval: starting over",
    ]
