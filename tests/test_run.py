"""run() in-process: validation before loading, the record store's guarantees, W&B failures, offline."""

from __future__ import annotations

import json
import socket

import pytest
from conftest import make_config

from h2o_eval import results, tracking
from h2o_eval.errors import ConfigError
from h2o_eval.run import run, validate


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
    ask_02 = results.record_path(tmp_path, validate(make_config(data_dir, tmp_path, policy="full", budget=0.2)))
    ask_05 = results.record_path(tmp_path, validate(make_config(data_dir, tmp_path, policy="full", budget=0.5)))
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
    saved = json.loads(results.record_path(tmp_path / "results", validate(config)).read_text())
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
    settings = {"mode": "offline", "project": "h2o_eval_test", "entity": None, "group": "g", "tags": ["t"]}
    run_id = tracking.log_run(settings, record, "run-name", tmp_path)
    assert list(tmp_path.rglob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    (logged,) = started
    assert at_finish["config"]["budget"] == 0.2 and at_finish["config"]["model"] == {"name": "x"}
    assert at_finish["summary"]["acc"] == 0.75 and at_finish["summary"]["n_samples"] == 4
    assert (logged.group, logged.tags, logged.name) == ("g", ("t",), "run-name")


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
