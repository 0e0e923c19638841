"""The benchmarks measure what they say they measure, on a tiny model and the shared data: the full cache of
``decode_speed`` and ``stacked_decode`` generates plain ``generate``'s tokens, eviction holds fewer bytes, and
``same_numbers`` reports any number that moved. Every benchmark's command line parses."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

from h2o_eval.benchmarks import board_compare, decode_speed, linear_layout, same_numbers, stacked_decode
from h2o_eval.decode import bucket
from h2o_eval.models import load_model

# The commands; a module named _... is a part of one.
BENCHMARKS = sorted(path.stem for path in (REPO / "h2o_eval" / "benchmarks").glob("[!_]*.py"))
NEW_TOKENS, QUESTION = 6, 8


@pytest.fixture(scope="module")
def tiny(data_dir):
    """tiny-llama and two 72-token windows of XSUM, as ``decode_speed`` and ``stacked_decode`` both take them."""
    model, tokenizer = load_model("tiny-llama", device="cpu")
    return model, decode_speed.prompts(tokenizer, data_dir, 2, 64 + QUESTION)


def generated(model, setting, ids):
    return decode_speed.run(model, setting, ids, NEW_TOKENS, 0.25, QUESTION)


def test_decode_speed_full_cache_generates_plain_generate_tokens_and_h2o_holds_a_quarter(tiny):
    model, ids = tiny
    _, _, plain, plain_bytes = generated(model, "plain", ids)
    _, _, full, full_bytes = generated(model, "full", ids)
    _, _, h2o, h2o_bytes = generated(model, "h2o:context", ids)
    assert plain.shape == (2, NEW_TOKENS) and torch.equal(full, plain)
    # Plain holds each token fed (the prompt and every new token but the last); the full cache holds them in buffers
    # that grow a bucket at a time, which the first decode step opened.
    fed = 64 + QUESTION + NEW_TOKENS - 1
    assert full_bytes == plain_bytes // fed * bucket(64 + QUESTION + 1)
    assert h2o_bytes <= 0.3 * plain_bytes
    assert not torch.equal(h2o, plain), "eviction changed no token: the comparison proves little"


def test_stacked_decode_full_cell_generates_plain_generate_tokens(tiny, data_dir, tmp_path, monkeypatch):
    """The stack's first cell is the full cache: its rows are what plain ``generate`` makes of the same prompts."""
    model, ids = tiny
    monkeypatch.setattr("h2o_eval.threads.apply", lambda threads: None)  # keep this process's threads
    ids_file = tmp_path / "ids.json"
    argv = ["--data-dir", str(data_dir), "--model", "tiny-llama", "--length", "64", "--rows", "2"]
    argv += ["--question", str(QUESTION), "--new-tokens", str(NEW_TOKENS), "--ids", str(ids_file)]
    monkeypatch.setattr(sys, "argv", ["stacked_decode", *argv])
    stacked_decode.main()
    rows = json.loads(ids_file.read_text())
    assert len(rows) == 2 * (1 + 2 * 4)  # full, then snapkv and streaming at kvpress's four ratios
    assert rows[:2] == generated(model, "plain", ids)[2].tolist()


def test_stacked_decode_of_random_ids_generates_the_same_tokens_eagerly_and_replayed(monkeypatch, capsys):
    """Without a data folder the contexts are seeded random ids (a model of random weights, as on a GPU); the decode
    steps eager and replayed under the CUDA graphs' emulation make the same tokens, and each mode prints its step's
    time."""
    monkeypatch.setattr("h2o_eval.threads.apply", lambda threads: None)
    argv = ["--model", "tiny-llama", "--length", "64", "--rows", "1", "--question", str(QUESTION)]
    argv += ["--new-tokens", str(NEW_TOKENS), "--policies", "full,h2o", "--graphs", "off,emulate"]
    monkeypatch.setattr(sys, "argv", ["stacked_decode", *argv])
    stacked_decode.main()
    lines = capsys.readouterr().out.splitlines()
    assert [("graphs off" in line, "graphs emulate" in line) for line in lines[:2]] == [(True, False), (False, True)]
    assert all(" ms a step" in line for line in lines[:2])
    assert lines[2] == "the same ids in every mode: yes"


def write_set(folder, metric=0.5, output="a", extra=None):
    """A folder as ``same_numbers run`` leaves it: one setting's record and its outputs (with a timing)."""
    setting = folder / next(iter(same_numbers.SETTINGS))
    setting.mkdir(parents=True)
    rows = [{"doc_id": 0, "output": output, "seconds": metric * 7}]
    (setting / "r.outputs.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    record = {
        "metrics": {"acc": metric}, "capacity": {"kept": 0.2}, "outputs": "r.outputs.jsonl", "policy": "h2o",
        "config": {"policy": {"name": "h2o"}},
    }  # fmt: skip
    (setting / "copa__h2o__1234abcd.json").write_text(json.dumps({**record, "budget": 0.2}))
    if extra:
        (setting / "copa__full__99999999.json").write_text(json.dumps({**record, "policy": "full", "budget": 1}))


@pytest.mark.parametrize(
    ("after", "same", "differs"),
    [
        ({}, True, "| nothing |"),
        ({"metric": 0.75}, False, "| metrics |"),  # its timing moved too, and is not compared
        ({"output": "b"}, False, "| outputs |"),
        ({"extra": True}, False, "| only after |"),
    ],
)
def test_same_numbers_reports_every_record_that_moved(tmp_path, capsys, after, same, differs):
    write_set(tmp_path / "before")
    write_set(tmp_path / "after", **after)
    assert same_numbers.compare(tmp_path / "before", tmp_path / "after") is same
    assert differs in capsys.readouterr().out


def test_same_numbers_names_a_wrappers_base(tmp_path, capsys):
    """Ada-KV over Expected Attention and over Compactor at one budget are two cells: each line names its base."""
    for side in ("before", "after"):
        write_set(tmp_path / side)
        setting = next((tmp_path / side).iterdir())
        for base, digest in (("expected_attention", "11111111"), ({"name": "compactor"}, "22222222")):
            record = json.loads((setting / "copa__h2o__1234abcd.json").read_text())
            record |= {"policy": "adakv", "config": {"policy": {"name": "adakv", "base": base}}}
            (setting / f"copa__adakv__{digest}.json").write_text(json.dumps(record))
    assert same_numbers.compare(tmp_path / "before", tmp_path / "after") is True
    out = capsys.readouterr().out
    assert "| adakv(expected_attention)@0.2 |" in out and "| adakv(compactor)@0.2 |" in out and "| h2o@0.2 |" in out


def test_same_numbers_compares_two_results_dirs_and_refuses_folders_without_records(tmp_path, capsys):
    """Two grids' ``results_dir`` (records at their top) are compared as one setting; two folders holding no
    record are refused in one line, not reported as agreeing."""
    for side, output in (("before", "a"), ("after", "b")):
        write_set(tmp_path / side, output=output)
        setting = next((tmp_path / side).iterdir())
        for path in setting.iterdir():
            path.rename(tmp_path / side / path.name)
        setting.rmdir()
    assert same_numbers.compare(tmp_path / "before", tmp_path / "after") is False
    assert "| . | h2o@0.2 | acc | 0.5000 | 0.5000 | outputs |" in capsys.readouterr().out
    for side in ("empty_before", "empty_after"):
        (tmp_path / side).mkdir()
    with pytest.raises(SystemExit, match=r"^error: no records in .*: compare two folders that `same_numbers run`"):
        same_numbers.compare(tmp_path / "empty_before", tmp_path / "empty_after")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_command_line_parses(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit:
        importlib.import_module(f"h2o_eval.benchmarks.{name}").main()
    assert exit.value.code == 0 and capsys.readouterr().out.startswith("usage:")


def test_long_forward_refuses_a_setting_it_does_not_have_naming_those_it_has(monkeypatch, capsys):
    """``--only h2o:prefil`` (a typo) measured nothing but the full cache; it is refused before anything runs."""
    from h2o_eval.benchmarks import long_forward

    monkeypatch.setattr(sys, "argv", ["long_forward", "--data-dir", ".", "--only", "h2o:prefill", "h2o:prefil"])
    with pytest.raises(SystemExit) as exit:
        long_forward.main()
    error = capsys.readouterr().err.splitlines()[-1]
    assert exit.value.code == 2 and "--only: no setting h2o:prefil; the settings are none:-, h2o:simulate," in error


def test_gpu_check_finds_the_kernels_equal_on_the_cpu_and_fails_on_a_difference(monkeypatch, capsys):
    """Reference: the check's own claim (kernels=triton generates what kernels=torch does, graphs what eager decoding
    does, and the full cache what plain generate does), which the interpreted kernels meet (on the CPU the graphs
    run eagerly); then a triton run, or a graphed one, that generates other tokens must be a DIFF line and exit
    status 1."""
    from h2o_eval import generation
    from h2o_eval.benchmarks import gpu_check

    options = ["--device", "cpu", "--models", "tiny-llama3", "--dtypes", "float32", "--policies", "full", "h2o"]
    with pytest.raises(SystemExit) as done:
        gpu_check.main(options)
    out = capsys.readouterr().out.splitlines()
    assert done.value.code == 0
    assert [line.split(":")[0] for line in out[:-1]] == [
        f"ok   tiny-llama3 float32 {protocol} {decoding} {name}"
        for protocol in ("prefill", "context")
        for decoding in ("evict", "grow")
        for name in ("full", "h2o")
    ]
    assert "tokens equal plain generate's True" in out[0]
    real = generation.generate

    for differs, wrong in (
        (lambda kernels, graphs: kernels == "triton", "kernels"),
        (lambda k, graphs: graphs, "graphs"),
    ):

        def other_tokens(*args, kernels, graphs, differs=differs, **kwargs):
            tokens, cache = real(*args, kernels=kernels, graphs=graphs, **kwargs)
            return (tokens + 1 if differs(kernels, graphs) else tokens), cache

        monkeypatch.setattr(generation, "generate", other_tokens)
        with pytest.raises(SystemExit) as done:
            gpu_check.main([*options[:-2], "h2o", "--protocols", "prefill", "--decodings", "evict"])
        out = capsys.readouterr().out.splitlines()
        assert done.value.code == 1
        assert out[0].startswith("DIFF tiny-llama3 float32 prefill evict h2o: ")
        assert (
            f"{wrong}" + (": tokens equal False" if wrong == "kernels" else " (0 replays): tokens equal False")
            in out[0]
        )
        assert out[-1] == "gpu_check: 1 float32 case(s) differ (kernels=torch against triton, or graphs against eager)"


def test_gpu_check_by_default_checks_every_policy_that_holds_a_cache():
    """Reference: the registry. Every policy but the one that holds no cache, ``dms`` too at its example threshold:
    the default list once stopped the whole check at ``dms``, which a budget alone cannot build."""
    from h2o_eval.benchmarks.gpu_check import cache_policies
    from h2o_eval.policies import POLICIES

    assert cache_policies() == [name for name in POLICIES if name != "h2o_reference"]
    assert cache_policies(["dms", "h2o_reference", "h2o"]) == ["dms", "h2o"]


def test_gpu_check_grid_answers_with_graphs_as_eagerly_and_fails_without_replays_or_on_a_difference(
    monkeypatch, capsys
):
    """Reference: the grid's answers without graphs, one copy at a time (and the reasoning runner's batches, rows
    leaving, without graphs). With the graphs' emulation (the CPU's) the same cells answer the same, copies, stacks
    and batches replaying steps; a graphed run that answers otherwise, or that replays nothing on a model whose steps
    are captured, must be a DIFF line and exit status 1."""
    from h2o_eval.benchmarks import gpu_check
    from h2o_eval.graphs import DecodeGraphs

    options = ["--device", "cpu", "--models", "tiny-llama3", "--policies", "full", "h2o", "--grid"]
    with pytest.raises(SystemExit) as done:
        gpu_check.main(options)
    out = capsys.readouterr().out.splitlines()
    assert done.value.code == 0, out
    assert [line.split(":")[0] for line in out[:-1]] == [
        "ok   grid tiny-llama3 float32 evict one copy at a time",
        "ok   grid tiny-llama3 float32 grow one copy at a time",
        "ok   grid tiny-llama3 float32 grow stacked",
        "ok   leaving tiny-llama3 float32",
    ]
    assert all(" 0 replays" not in line for line in out[:-1]) and all("4 of 4 cells" in line for line in out[:3])
    assert "4 of 4 policies' rows" in out[3]
    real = gpu_check.grid_answers

    def otherwise(model, tokenizer, names, decoding, stack, graphs, kernels):
        answers = real(model, tokenizer, names, decoding, stack, graphs, kernels)
        return [[[token + 1 for token in row] for row in cell] for cell in answers] if graphs else answers

    for patch in ((gpu_check, "grid_answers", otherwise), (DecodeGraphs, "step", lambda self, *args: None)):
        with monkeypatch.context() as patched:
            patched.setattr(*patch)
            with pytest.raises(SystemExit) as done:
                gpu_check.main(options)
        out = capsys.readouterr().out.splitlines()
        assert done.value.code == 1
        differing = 3 if patch[1] == "grid_answers" else 4  # the batches' line does not answer through the grid
        assert [line[:4] for line in out[:-1]] == ["DIFF"] * differing + ["ok  "] * (4 - differing)
        assert out[-1].startswith(f"gpu_check: {differing} grid setting(s) differ")


def test_gpu_check_refuses_an_unknown_policy_in_one_line(capsys):
    from h2o_eval.benchmarks import gpu_check

    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--device", "cpu", "--models", "tiny-llama3", "--dtypes", "float32", "--policies", "nope"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "h2o" in err and len(err.strip().splitlines()) == 1


def test_a_timed_command_runs_beside_busy_processes_that_stop_with_its_round(monkeypatch, tmp_path):
    """benchmarks.commands: each run is a fresh process in a fresh results folder, its CPU time its own; the busy
    processes beside a round spin while it runs and are gone after it."""
    from h2o_eval.benchmarks import commands

    seen = tmp_path / "seen"
    monkeypatch.setitem(commands.COMMANDS, "probe", f"python -c 'sum(range(10**7)); print(\"{{out}}\")' >> {seen}")
    busy = f"import os; open('{tmp_path}/busy-' + str(os.getpid()), 'w').close()\nwhile True: pass"
    monkeypatch.setattr(commands, "BUSY", busy)
    runs = commands.round_of("probe", argparse.Namespace(runs=2, data_dir=tmp_path), 2, tmp_path)
    assert len(runs) == 2 and all(code == 0 and cpu > 0 and wall > 0 for wall, cpu, code in runs)
    folders = seen.read_text().split()
    assert len(set(folders)) == 2 and not any(Path(folder).exists() for folder in folders)
    pids = [int(path.name.split("-")[1]) for path in tmp_path.glob("busy-*")]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_linear_layout_times_every_product_both_ways_at_each_number_of_rows(monkeypatch, capsys):
    monkeypatch.setattr(linear_layout, "apply_threads", lambda threads: None)  # the worker's threads stay
    monkeypatch.setattr(sys, "argv", ["linear_layout", "--model", "tiny-llama", "--rows", "1", "3", "--tries", "1"])
    linear_layout.main()
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    products = ("query", "key, value", "output", "gate, up", "down", "logits")
    assert [(row[0].lstrip("| "), row[2]) for row in rows] == [(name, n) for name in products for n in ("1", "3")]
    assert all(float(row[3]) >= 0 and float(row[4]) >= 0 and row[6] in ("yes |", "no |") for row in rows)


def test_board_compares_kvpress_side_builds_the_grids_random_model_from_a_json_job():
    """Reference: h2o_eval's random model (load_model); implementation: the model kvpress's process builds from the
    job board_compare writes it (its config and seed, through JSON), as on a GPU for Llama-3-8B's shapes."""
    job = json.loads(json.dumps({**board_compare.model_job("tiny-llama"), "device": "cpu"}))
    built, (reference, _) = board_compare.job_model(job), load_model("tiny-llama", device="cpu")
    assert built.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(built.state_dict()[k], v) for k, v in reference.state_dict().items())
    assert board_compare.model_job("smollm2-135m")["folder"] == board_compare.model_job("smollm2-135m")["tokenizer"]


def test_board_compare_runs_the_grid_on_the_gpu_in_bfloat16_with_the_answers_length_it_is_given():
    parse = argparse.Namespace
    cpu = parse(device="cpu", data_dir=None, length=None, new_tokens=None)
    assert board_compare.settings(cpu) == []
    cuda = parse(device="cuda", data_dir=Path("data"), length=4096, new_tokens=32)
    assert board_compare.settings(cuda) == [
        f"data_dir={Path('data').resolve()}", "device=cuda", "dtype=bfloat16", "task.length=4096",
        "task.max_new_tokens=32",
    ]  # fmt: skip
