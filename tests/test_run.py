"""run() in-process: validation before loading, the record store's guarantees, W&B failures, offline."""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import stat
import threading
import time

import pytest
import test_plot
import torch
from conftest import make_config

from h2o_eval import hub, results, stats, tracking
from h2o_eval import run as run_module
from h2o_eval.errors import ConfigError
from h2o_eval.models import load_model
from h2o_eval.policies import configured_policy
from h2o_eval.run import PeakMemory, _vm_hwm, _warn_tiny_budget, execute, run, summary_line, validate


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr("h2o_eval.models.load_model", refuse)


@pytest.mark.parametrize(
    "override",
    [
        {"budget": 0},
        {"budget": 2.5},
        {"budget": True},
        {"limit": 0},
        {"limit": 1.0},
        {"num_fewshot": -2},
        {"batch_size": 0},
        {"protocol": "decode"},
        {"wandb": {"mode": "sometimes"}},
    ],
)
def test_bad_settings_are_rejected_before_the_model_loads(tmp_path, data_dir, no_model_loading, override):
    config = make_config(data_dir, tmp_path, model="smollm2-135m", task="copa")
    with pytest.raises(ConfigError):
        run({**config, **override}, tmp_path)


def test_missing_data_file_names_the_path_and_the_setting(tmp_path, no_model_loading):
    config = make_config(tmp_path / "empty", tmp_path, task="mathqa")
    with pytest.raises(ConfigError, match=r"no data file .*empty/mathqa/test\.jsonl.*data_dir="):
        run(config, tmp_path)


def test_full_policy_records_budget_one_whatever_was_asked(tmp_path, data_dir, no_model_loading):
    ask_02 = results.record_path(tmp_path, validate(make_config(data_dir, tmp_path, policy="full", budget=0.2)).config)
    ask_05 = results.record_path(tmp_path, validate(make_config(data_dir, tmp_path, policy="full", budget=0.5)).config)
    assert ask_02 == ask_05 and "__b1.0__" in ask_02.name


def test_record_names_differ_for_every_setting_that_changes_the_numbers(tmp_path, data_dir):
    base = make_config(data_dir, tmp_path)
    variants = [
        base,
        {**base, "num_fewshot": 5},
        {**base, "limit": 10},
        {**base, "seed": 1},
        {**base, "dtype": "bfloat16"},
        {**base, "data_dir": None},
    ]
    assert len({results.record_path(tmp_path, v) for v in variants}) == len(variants)
    same = [
        {**base, "batch_size": 64},
        {**base, "overwrite": True},
        {**base, "wandb": {"mode": "online"}},
        {**base, "kernels": "torch"},
        {**base, "generation": {**base["generation"], "max_new_tokens": 7}},
    ]
    assert {results.record_path(tmp_path, v) for v in same} == {results.record_path(tmp_path, base)}


def test_interrupted_write_leaves_no_record_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "run.json"

    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(KeyboardInterrupt):
        results.write_record(path, {"metrics": {"acc": 0.5}})
    assert list(tmp_path.iterdir()) == []


def test_wandb_failure_keeps_the_local_record(tmp_path, data_dir, monkeypatch, capsys):
    import wandb

    def broken_init(**kwargs):
        raise RuntimeError("W&B is down")

    monkeypatch.setattr(wandb, "init", broken_init)
    config = make_config(data_dir, tmp_path / "results", model="tiny-gpt2", task="rte", limit=4)
    config["wandb"]["mode"] = "offline"
    record = run(config, tmp_path / "work")
    assert "W&B logging failed (RuntimeError: W&B is down)" in capsys.readouterr().err
    saved = json.loads(results.record_path(tmp_path / "results", validate(config).config).read_text())
    assert saved["metrics"] == record["metrics"]


def test_wandb_offline_run_carries_config_and_metrics(tmp_path, monkeypatch):
    import wandb

    started, at_finish = [], {}
    real_init = wandb.init

    def init(**kwargs):
        logged = real_init(**kwargs)
        real_finish = logged.finish
        logged.finish = lambda: (
            at_finish.update(summary=dict(logged.summary), config=dict(logged.config)) or (real_finish())
        )
        started.append(logged)
        return logged

    monkeypatch.setattr(wandb, "init", init)
    record = {
        "config": {"model": {"name": "x"}, "budget": 0.2},
        "metrics": {"acc": 0.75},
        "n_samples": 4,
        "wall_seconds": 1.0,
    }
    settings = {
        "mode": "offline",
        "project": "h2o_eval_test",
        "entity": None,
        "group": "g",
        "tags": ["t"],
        "init_timeout": 20,
    }
    run_id = tracking.log_run(settings, record, "run-name", tmp_path)
    assert list(tmp_path.rglob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    (logged,) = started
    assert at_finish["config"]["budget"] == 0.2 and at_finish["config"]["model"] == {"name": "x"}
    assert at_finish["summary"]["acc"] == 0.75 and at_finish["summary"]["n_samples"] == 4
    assert (logged.group, logged.tags, logged.name) == ("g", ("t",), "run-name")


def test_what_wandb_prints_goes_to_the_log_and_not_to_the_terminal(tmp_path, capsys, caplog):
    record = {"config": {"budget": 0.2}, "metrics": {"acc": 0.5}, "n_samples": 2, "wall_seconds": 1.0}
    settings = {"mode": "offline", "project": "p", "entity": None, "group": None, "tags": [], "init_timeout": 20}
    with caplog.at_level(logging.INFO, logger="h2o_eval.tracking"):
        run_id = tracking.log_run(settings, record, "quiet", tmp_path)
    assert run_id is not None
    printed = capsys.readouterr()
    assert "wandb" not in printed.out + printed.err
    logged = [r.getMessage() for r in caplog.records if r.name == "h2o_eval.tracking"]
    assert any(line.startswith("wandb: wandb sync ") and str(tmp_path) in line for line in logged), logged


def test_a_local_data_run_attempts_no_network(tmp_path, data_dir, monkeypatch):
    attempts = []
    real_connect = socket.socket.connect

    def guarded_connect(sock, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (
            host.startswith("127.") or host in ("::1", "localhost") or sock.family == socket.AF_UNIX
        ):
            attempts.append(address)
            raise OSError(f"network blocked in test: {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    config = make_config(data_dir, tmp_path / "results", model="tiny-opt", task="winogrande", limit=4)
    record = run(config, tmp_path / "work")
    assert record["n_samples"] == 4
    assert attempts == []


@pytest.mark.parametrize("protocol", ["simulate", "prefill"])
def test_record_carries_the_policy_protocol_and_realised_capacities(tmp_path, data_dir, protocol):
    config = make_config(
        data_dir,
        tmp_path / "results",
        model="tiny-qwen2",
        task="copa",
        policy="h2o",
        budget=0.25,
        protocol=protocol,
        limit=6,
        **{"policy.heavy_ratio": 0.25},
    )
    record = run(config, tmp_path / "work")
    assert (record["policy"], record["budget"], record["heavy_ratio"], record["protocol"]) == (
        "h2o",
        0.25,
        0.25,
        protocol,
    )
    capacity = record["capacity"]
    assert capacity["sequences"] == 12  # 6 documents x 2 choices, each scored once
    assert 1 <= capacity["capacity_min"] <= capacity["capacity_mean"] <= capacity["capacity_max"]
    assert 0.25 <= capacity["kept_fraction_mean"] < 0.5  # ceil(0.25 * length) of short COPA requests


def test_per_document_scores_of_a_record_match_its_metrics(tmp_path, data_dir):
    """lm-eval's logged samples are kept beside the record: the paired comparisons read them."""
    config = make_config(data_dir, tmp_path / "results", model="tiny-llama", task="piqa", limit=7)
    record = run(config, tmp_path / "work")
    rows = [json.loads(line) for line in (tmp_path / "results" / record["outputs"]).read_text().splitlines()]
    assert [row["id"] for row in rows] == list(range(7))
    for metric in ("acc", "acc_norm"):
        per_document = stats.document_scores(record, tmp_path / "results", metric)
        assert set(per_document.values()) <= {0.0, 1.0}
        assert record["metrics"][metric] == pytest.approx(sum(per_document.values()) / 7, abs=1e-12)


def test_generation_settings_are_checked_before_the_model_loads(tmp_path, data_dir, no_model_loading):
    with pytest.raises(ConfigError, match="policy=h2o_reference is a simulation of scoring only"):
        run(make_config(data_dir, tmp_path, task="xsum", policy="h2o_reference"), tmp_path)
    with pytest.raises(ConfigError, match=r"generation.max_new_tokens=0: use an integer >= 1"):
        run(make_config(data_dir, tmp_path, task="xsum", **{"generation.max_new_tokens": 0}), tmp_path)
    with pytest.raises(ConfigError, match=r"no data file .*nowhere/cnn_dailymail/test.jsonl"):
        run(make_config(tmp_path / "nowhere", tmp_path, task="cnn_dailymail"), tmp_path)


def test_generation_settings_name_a_different_record_only_for_generation_tasks(tmp_path, data_dir):
    xsum = make_config(data_dir, tmp_path, task="xsum")
    longer = {**xsum, "generation": {**xsum["generation"], "max_new_tokens": 7}}
    assert results.record_path(tmp_path, xsum) != results.record_path(tmp_path, longer)


def copy_task_data(data_dir, folder, task="copa", rows=None):
    """``folder/<task>/<split>.jsonl`` holding the first ``rows`` rows of the shared data (all if None)."""
    split = "test" if task in ("xsum", "cnn_dailymail", "mathqa", "openbookqa") else "validation"
    lines = (data_dir / task / f"{split}.jsonl").read_text().splitlines(keepends=True)
    target = folder / task / f"{split}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(lines[:rows]))
    return target


def test_identity_follows_the_data_content_not_its_folder(tmp_path, data_dir, no_model_loading):
    copy_task_data(data_dir, tmp_path / "a")
    copy_task_data(data_dir, tmp_path / "same")
    copy_task_data(data_dir, tmp_path / "fewer", rows=50)
    path = {
        name: results.record_path(tmp_path, make_config(tmp_path / name, tmp_path)) for name in ("a", "same", "fewer")
    }
    assert path["a"] == path["same"] != path["fewer"]
    assert results.record_path(tmp_path, make_config(None, tmp_path)) not in path.values()


@pytest.mark.slow
def test_same_command_on_changed_data_is_recomputed_under_a_new_identity(tmp_path, data_dir, capsys):
    file = copy_task_data(data_dir, tmp_path / "data")
    config = make_config(tmp_path / "data", tmp_path / "results", model="tiny-llama", task="copa", limit=3)
    status, first = execute(validate(config), tmp_path / "work")
    file.write_text("".join(reversed(file.read_text().splitlines(keepends=True))))  # other documents first
    again, second = execute(validate(config), tmp_path / "work")
    assert (status, again) == ("ran", "ran") and "skipped" not in capsys.readouterr().out
    assert first["data"] != second["data"]
    assert len(list((tmp_path / "results").glob("*.json"))) == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"premise": "a", "choice1": "b"}\n{"premise": "a", "choice1\n', r"validation\.jsonl:2: not a JSON line"),
        ('{"premise": "a", "label": 0}\n\n{"premise": "b"}\n', r"validation\.jsonl:3: no field label: add it"),
        ('["premise"]\n', r"validation\.jsonl:1: a JSON object per line"),
        ("", r"validation\.jsonl holds no rows"),
    ],
)
def test_a_bad_data_file_names_its_row_before_the_model_loads(tmp_path, no_model_loading, content, message):
    (tmp_path / "data" / "copa").mkdir(parents=True)
    (tmp_path / "data" / "copa" / "validation.jsonl").write_text(content)
    with pytest.raises(ConfigError, match=message):
        run(make_config(tmp_path / "data", tmp_path / "results", task="copa"), tmp_path)
    assert not (tmp_path / "results").exists()


def test_a_summarisation_row_without_the_templates_field_is_named(tmp_path, data_dir, no_model_loading):
    file = copy_task_data(data_dir, tmp_path / "data", task="xsum", rows=3)
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    file.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "summary"}) + "\n" for row in rows))
    with pytest.raises(ConfigError, match=r"test\.jsonl:1: no field summary"):
        run(make_config(tmp_path / "data", tmp_path / "results", task="xsum"), tmp_path)


@pytest.mark.parametrize(
    "content", ['{"model": "tiny-llama", "metr', pytest.param('{"foo": 1}', marks=pytest.mark.slow)]
)
def test_an_unreadable_record_is_set_aside_named_and_rerun(tmp_path, data_dir, capsys, content):
    config = make_config(data_dir, tmp_path / "results", model="tiny-llama", task="copa", limit=2)
    path = results.record_path(tmp_path / "results", validate(config).config)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    status, record = execute(validate(config), tmp_path / "work")
    assert status == "ran" and results.read_record(path) == json.loads(json.dumps(record, default=str))
    assert str(path) in capsys.readouterr().err
    assert (tmp_path / "results" / "unreadable" / path.name).read_text() == content


def _save_partial(path):
    from h2o_eval.generation.partial import Partial

    Partial(path, ["run.json"], made={"device": "cpu", "threads": 1}).save(1, {("context", 0)}, [["a"]])


@pytest.mark.parametrize("write", [lambda path: results.write_record(path, {"metrics": {}}), _save_partial])
@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_records_and_partial_answers_are_readable_as_the_umask_allows_and_clear_a_killed_writes_leftover(
    tmp_path, write, umask, mode
):
    """A partial file is committed and taken up by others like a record: both get the umask's mode, not mkstemp's
    0600, and a temporary file that a process killed mid-write left beside one is gone after the next write."""
    path = tmp_path / "run.json"
    leftover = tmp_path / ".run.k1ll3d.tmp"
    leftover.write_text("{")
    previous = os.umask(umask)
    try:
        write(path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_a_run_waiting_for_the_lock_says_what_it_waits_for(tmp_path, capsys):
    record = tmp_path / "setting.json"
    entered = threading.Event()

    def second_run():
        with results.exclusive(record):
            entered.set()

    with results.exclusive(record):
        waiter = threading.Thread(target=second_run)
        waiter.start()
        waiter.join(0.5)
        assert not entered.is_set()
    waiter.join(10)
    assert entered.is_set()
    lock = tmp_path / ".setting.lock"
    assert capsys.readouterr().out == f"waiting: another process is computing setting.json (it holds {lock})\n"
    assert not lock.exists()


def test_runs_queued_on_a_lock_hold_it_one_at_a_time_and_leave_no_lock_file(tmp_path):
    """Its holder removes the lock file as it leaves; runs that waited on the removed file lock the next one, so
    that no two ever hold the setting at once."""
    record, inside, most = tmp_path / "setting.json", [], []

    def run(arrives: float):
        time.sleep(arrives)  # some queue on a file its holder then removes, some come after it was removed
        with results.exclusive(record):
            inside.append(1)
            most.append(len(inside))
            time.sleep(0.05)
            inside.pop()

    runs = [threading.Thread(target=run, args=(0.02 * i,)) for i in range(6)]
    for thread in runs:
        thread.start()
    for thread in runs:
        thread.join(20)
    assert len(most) == 6 and max(most) == 1
    assert not list(tmp_path.glob(".*.lock"))


@pytest.fixture
def wandb_environment(monkeypatch):
    """Set W&B's environment variables for one test: W&B reads them once per process, at its setup."""
    import wandb

    wandb.teardown()
    yield monkeypatch.setenv
    monkeypatch.undo()
    wandb.teardown()


def test_wandb_online_that_never_answers_costs_a_bounded_wait_and_one_line(tmp_path, wandb_environment, capsys):
    """A local server that accepts connections and never answers stands in for a network that hangs."""
    server = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.extend(server.accept() for _ in range(64)), daemon=True).start()
    wandb_environment("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    wandb_environment("WANDB_API_KEY", "0" * 40)
    record = {"config": {"budget": 0.2}, "metrics": {"acc": 0.5}, "n_samples": 2, "wall_seconds": 1.0}
    settings = {"mode": "online", "project": "p", "entity": None, "group": None, "tags": [], "init_timeout": 2}
    began = time.monotonic()
    assert tracking.log_run(settings, record, "hang", tmp_path) is None
    assert time.monotonic() - began < 60  # W&B alone would wait 90 s, then retry
    assert held, "W&B never reached the stand-in server"
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert "W&B logging failed (CommError: Timed out" in line and "wandb.init_timeout=2 s" in line


def test_wandb_online_without_a_network_gives_up_at_once(tmp_path, wandb_environment, capsys):
    wandb_environment("WANDB_BASE_URL", "http://wandb.invalid")
    record = {"config": {}, "metrics": {"acc": 0.5}, "n_samples": 2, "wall_seconds": 1.0}
    settings = {"mode": "online", "project": "p", "entity": None, "group": None, "tags": [], "init_timeout": 20}
    began = time.monotonic()
    assert tracking.log_run(settings, record, "offline", tmp_path) is None
    assert time.monotonic() - began < 10
    assert "warning: W&B logging failed (ConnectionError: wandb.invalid is unreachable" in capsys.readouterr().err


def test_a_tiny_integer_budget_is_pointed_out(capsys):
    record = {"budget": 1, "capacity": {"kept_fraction_mean": 0.04}}
    _warn_tiny_budget(record)
    _warn_tiny_budget({**record, "budget": 1.0})
    _warn_tiny_budget({**record, "capacity": {"kept_fraction_mean": 0.5}})
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: budget=1 is a number of tokens and kept 4% of the sequence")


def test_hub_model_and_data_without_a_connection_are_refused_at_once(tmp_path, data_dir, monkeypatch, no_model_loading):
    """Not offline by setting, but no network: a connection probe, instead of a minute of retries."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"task=copa reads aps/super_glue .*hub\.invalid is unreachable.*data_dir"):
        run(make_config(None, tmp_path, task="copa"), tmp_path)
    with pytest.raises(
        ConfigError, match=r"model=llama-7b: huggyllama/llama-7b is not in .*hub\.invalid is unreachable"
    ):
        run(make_config(data_dir, tmp_path, model="llama-7b"), tmp_path)
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("cache", ["hub", "datasets"])
def test_hub_data_in_a_local_cache_is_accepted_offline(tmp_path, monkeypatch, cache):
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    with pytest.raises(ConfigError, match="aps/super_glue from the Hugging Face hub, which is not cached here"):
        hub.check_dataset("copa", "aps/super_glue")
    folder = {"hub": "hub/datasets--aps--super_glue", "datasets": "datasets/aps___super_glue"}[cache]
    (tmp_path / folder).mkdir(parents=True)
    hub.check_dataset("copa", "aps/super_glue")


@pytest.mark.slow
def test_summarisation_progress_counts_documents(tmp_path, data_dir, capsys):
    config = make_config(
        data_dir, tmp_path, model="tiny-llama", task="xsum", limit=3, batch_size=2, **{"generation.max_new_tokens": 2}
    )
    run(config, tmp_path / "work")
    progress = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert [line for line in progress if "generating xsum" in line][-1].startswith("generating xsum: 100%")
    assert any("| 3/3 " in line and "doc" in line for line in progress)  # documents, not 2 batches


def test_a_record_names_the_commit_its_run_started_from(tmp_path, data_dir, commit_lands_during_the_run):
    config = make_config(data_dir, tmp_path / "results", model="tiny-llama", task="copa", policy="h2o", limit=2)
    status, record = execute(validate(config), tmp_path / "work")
    assert status == "ran" and record["git"] == {"commit": "started", "dirty": False}
    assert (
        results.read_record(results.record_path(tmp_path / "results", validate(config).config))["git"] == record["git"]
    )


def test_record_name_and_summary_line_name_length_questions_decoding_and_policy_parameters(tmp_path, data_dir):
    spec = validate(
        make_config(
            data_dir, tmp_path, model="tiny-llama", task="niah_single_2", policy="snapkv", budget=0.5,
            protocol="context", decoding="grow", **{"policy.window": 8, "task.questions": 2, "task.length": 1024},
        )
    )  # fmt: skip
    config = spec.config
    name = results.record_path(tmp_path, config).name
    assert name.startswith("tiny-llama__niah_single_2-1024__snapkv+window=8__b0.5__context-grow__2q__0shot__")
    default = validate(
        make_config(data_dir, tmp_path, model="tiny-llama", task="copa", policy="snapkv", protocol="prefill")
    ).config
    assert results.record_path(tmp_path, default).name.startswith("tiny-llama__copa__snapkv__b0.2__prefill-evict__0")
    record = {
        "config": config, "policy_params": configured_policy(config).describe(), "model": "tiny-llama",
        "task": "niah_single_2", "policy": "snapkv", "budget": 0.5, "protocol": "context", "num_fewshot": 0,
        "metrics": {"string_match_all": 0.5}, "n_samples": 4, "wall_seconds": 1.0,
    }  # fmt: skip
    line = summary_line(record, spec.departures)
    assert "niah_single_2 (1024 tokens, 2 questions per context)" in line
    assert "snapkv window=8 budget=0.5 context decoding=grow 0-shot |" in line


def test_a_record_stored_under_an_earlier_name_of_its_setting_is_found(tmp_path, data_dir, capsys):
    config = validate(make_config(data_dir, tmp_path, model="tiny-llama", task="copa", limit=2, policy="full")).config
    path = results.record_path(tmp_path, config)
    earlier = tmp_path / f"tiny-llama__copa__full__b1.0__simulate__0shot__{path.stem.rsplit('__', 1)[1]}.json"
    record = {**test_plot.fake_record("copa", "full", 1.0, 0.5), "wall_seconds": 1.0}
    results.write_record(earlier, record)
    assert execute(validate(config)) == ("skipped", record)
    assert f"skipped: {earlier} exists" in capsys.readouterr().out


def test_a_record_carries_its_evaluations_peak_memory_at_least_its_weights_outside_its_identity(tmp_path, data_dir):
    config = make_config(data_dir, tmp_path / "results", model="tiny-llama", task="copa", limit=2)
    status, record = execute(validate(config), tmp_path / "work")
    model, _ = load_model("tiny-llama", device="cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = record["peak_memory"]
    assert status == "ran" and peak["device"] == "cpu"
    assert peak["kind"] in ("resident set", "resident set since the process started")
    assert peak["bytes"] >= weights > 0
    path = results.record_path(tmp_path / "results", validate(config).config)
    assert results.read_record(path)["peak_memory"] == peak
    assert "peak_memory" not in json.dumps(results.identity(validate(config).config))


def test_the_cpu_peak_is_reset_at_an_evaluations_start():
    """A large block freed before the evaluation starts is not its peak (where Linux lets the peak be reset)."""
    size = 2**28  # 256 MiB mapped and touched apart from the heap, whose free blocks may already be resident
    with mmap.mmap(-1, size) as block:
        for page in range(0, size, mmap.PAGESIZE):
            block[page] = 1
    before = _vm_hwm()
    if before is None or not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("this system does not let a process read and reset its peak resident set")
    peak = PeakMemory(torch.device("cpu")).read()
    assert peak["kind"] == "resident set" and peak["bytes"] < before - 2**27


def test_without_a_resettable_peak_the_cpu_record_says_it_is_the_processs(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "PROC_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    peak = PeakMemory(torch.device("cpu")).read()
    assert peak["kind"] == "resident set since the process started" and peak["bytes"] > 0


def test_on_cuda_the_peak_is_the_allocators_reset_at_the_start(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append(("peak", device)) or 123)
    cuda = torch.device("cuda")
    peak = PeakMemory(cuda)
    assert calls == [("reset", cuda)]
    assert peak.read() == {"device": "cuda", "bytes": 123, "kind": "allocator"}
    assert calls == [("reset", cuda), ("peak", cuda)]
