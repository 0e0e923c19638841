"""The CLI contract, end to end in a subprocess: a run, its record, the rerun skip, and one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import fast_sample

RECORD_KEYS = {
    "model",
    "task",
    "policy",
    "budget",
    "heavy_ratio",
    "protocol",
    "num_fewshot",
    "limit",
    "metrics",
    "n_samples",
    "wall_seconds",
    "versions",
    "git",
    "config",
    "seed",
    "created",
    "schema_version",
}


def h2o_eval(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.run(
        [sys.executable, "-m", "h2o_eval", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_cli_runs_records_logs_and_skips_the_rerun(tmp_path, data_dir):
    args = (
        "model=tiny-llama",
        "task=piqa",
        "policy=full",
        "limit=12",
        "batch_size=4",
        f"data_dir={data_dir}",
        "results_dir=out",
    )
    done = h2o_eval(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = list((tmp_path / "out").glob("*.json"))
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    assert record.keys() >= RECORD_KEYS
    assert (record["model"], record["task"], record["policy"], record["protocol"]) == (
        "tiny-llama",
        "piqa",
        "full",
        "simulate",
    )
    assert record["n_samples"] == 12 and record["limit"] == 12
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= record["metrics"].keys()
    assert 0.0 <= record["metrics"]["acc"] <= 1.0
    assert record["config"]["data_dir"] == str(data_dir)
    assert record["versions"]["lm_eval"] and record["versions"]["transformers"].startswith("5.")
    assert "| piqa" in done.stdout and "acc" in done.stdout  # the summary table
    summary, where = done.stdout.strip().splitlines()[-2:]  # last, below lm-eval's table and W&B's output
    assert summary.startswith("tiny-llama | piqa | full budget=1.0") and where == f"record: {records[0]}"
    assert list((tmp_path / "out").rglob("offline-run-*/run-*.wandb")), "W&B offline run not written"
    assert not list((tmp_path / "out").glob(".*.tmp"))
    # lm-eval's log lines and W&B's messages go to the run's log file, not to the terminal
    terminal = done.stdout + done.stderr
    assert "[lm_eval." not in terminal and "wandb:" not in terminal, terminal[-3000:]
    assert "fatal: not a git repository" not in terminal  # run outside a checkout: lm-eval asks git quietly
    (log,) = (tmp_path / "out" / "hydra").rglob("__main__.log")
    assert "[lm_eval.evaluator]" in log.read_text() and "wandb: wandb sync " in log.read_text()

    before = records[0].stat().st_mtime_ns
    again = h2o_eval(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "skipped" in again.stdout
    assert records[0].stat().st_mtime_ns == before
    assert list((tmp_path / "out").glob("*.json")) == records


@pytest.mark.slow
def test_cfg_job_shows_the_resolved_config_from_any_directory(tmp_path):
    done = h2o_eval("--cfg", "job", "--resolve", "model=tiny-opt", "task=rte", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "name: tiny-opt" in done.stdout and "lm_eval_yaml: glue/rte/default.yaml" in done.stdout
    assert "\nprotocol: simulate\n" in done.stdout and "\nnum_fewshot: 0\n" in done.stdout


def test_cfg_job_shows_the_defaults_a_summarisation_run_will_use(tmp_path):
    done = h2o_eval("--cfg", "job", "--resolve", "task=xsum", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "\nprotocol: prefill\n" in done.stdout and "\nnum_fewshot: 5\n" in done.stdout


@pytest.mark.parametrize(
    ("args", "line"),
    fast_sample(
        [
            (["model=nonexistent"], "model=nonexistent: no model of that name: use one of gemma3-270m, gpt-neox-20b"),
            (["task=nonexistent"], "task=nonexistent: no task of that name: use one of aime24, aime25, cnn_dailymail"),
            (["policy=nonexistent"], "policy=nonexistent: no policy of that name: use one of adakv, block, chunk"),
            (["+experiment=nonexistent"], "+experiment=nonexistent: no experiment of that name: use one of kv_lead"),
            (["task.runner=nonexistent"], "task.runner='nonexistent': use one of lm_eval, summarisation, long_context"),
            (["--multirun", "policy=h2o,nonexistent"], "policy=nonexistent: no policy of that name: use one of"),
            (["--cfg", "job", "task=copa,nonexistent"], "task=nonexistent: no task of that name: use one of"),
        ],
        lambda case: case[0] in (["policy=nonexistent"], ["--multirun", "policy=h2o,nonexistent"]),
    ),
    ids=["model", "task", "policy", "experiment", "runner", "multirun", "cfg-job"],
)
def test_an_unknown_name_is_one_line_listing_the_public_names(tmp_path, args, line):
    done = h2o_eval(*args, "results_dir=out", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    (error,) = done.stderr.strip().splitlines()
    assert error.startswith(f"error: {line}"), error
    assert done.stdout == "" and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["budjet=0.5"], "budjet=0.5: the config has no setting 'budjet': did you mean budget?"),
        (["+budjet=0.5", "limit=2"], "+budjet=0.5: the config has no setting 'budjet': did you mean budget?"),
        (["--multirun", "budget=0.1,0.2", "+budjet=0.5"], "+budjet=0.5: the config has no setting 'budjet'"),
        (["policy=snapkv", "policy.windw=4"], "policy.windw=4: policy has no setting 'windw': did you mean window?"),
    ],
    ids=["typo", "added-typo", "multirun", "in-a-group"],
)
def test_a_key_the_config_does_not_define_is_one_line_naming_the_closest_and_torch_never_loads(tmp_path, args, line):
    """With or without ``+``, top-level or inside a group: refused in one line before Hydra composes anything, and
    before torch is imported (``-X importtime`` lists every module the refusal imported)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "h2o_eval", *args, "results_dir=out"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [row for row in done.stderr.splitlines() if not row.startswith("import time:")]
    assert errors == [f"error: {line}"] or (len(errors) == 1 and errors[0].startswith(f"error: {line}")), errors
    imported = {row.split("|")[-1].strip() for row in done.stderr.splitlines() if row.startswith("import time:")}
    assert "torch" not in imported and "transformers" not in imported
    assert done.stdout == "" and not list(tmp_path.iterdir())


def test_the_model_list_leaves_out_the_random_test_models_that_still_run_when_named(tmp_path):
    """The tiny random models of the tests and the shape models of the benchmarks work when named, but no list of
    names shows them."""
    done = h2o_eval("model=nonexistent", cwd=tmp_path)
    (error,) = done.stderr.strip().splitlines()
    assert "smollm2-135m" in error and "tiny-" not in error and "shape-" not in error
    done = h2o_eval("--cfg", "job", "model=tiny-llama", cwd=tmp_path)
    assert done.returncode == 0 and "name: tiny-llama" in done.stdout


@pytest.mark.parametrize(
    ("override", "message"),
    fast_sample(
        [
            ("budget=0", "budget=0: use a fraction in (0, 1]"),
            ("budget=1.5", "budget=1.5: use a fraction in (0, 1]"),
            ("budget=-3", "budget=-3"),
            ("limit=0", "limit=0: use a document count >= 1"),
            ("num_fewshot=-1", "num_fewshot=-1: use an integer >= 0"),
            ("protocol=stream", "protocol='stream': use one of simulate, prefill"),
            ("data_dir=nowhere", "nowhere/copa/validation.jsonl: put it there or change data_dir="),
            ("graphs=maybe", "graphs='maybe': use true, false or emulate"),
            ("threshold=abc", "threshold='abc': use a number"),
        ],
        lambda case: case[0] == "budget=1.5",
    ),
)
def test_bad_value_is_a_one_line_error_and_no_record(tmp_path, override, message):
    done = h2o_eval("model=smollm2-135m", "task=copa", override, cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
    assert not list(tmp_path.rglob("*.json"))


def bad_copa(tmp_path, content: str) -> str:
    (tmp_path / "data" / "copa").mkdir(parents=True)
    (tmp_path / "data" / "copa" / "validation.jsonl").write_text(content)
    return "data_dir=data"


@pytest.mark.parametrize(
    ("make_args", "message"),
    fast_sample(
        [
            (
                lambda tmp, data: ["model=llama-7b", f"data_dir={data}"],
                "huggyllama/llama-7b is not in the Hugging Face",
            ),
            (
                lambda tmp, data: [],
                "task=copa reads aps/super_glue from the Hugging Face hub, which is not cached here",
            ),
            (
                lambda tmp, data: [bad_copa(tmp, '{"premise": "a"}\n{"premise"\n')],
                "validation.jsonl:2: not a JSON line",
            ),
            (
                lambda tmp, data: [bad_copa(tmp, '{"premise": "a", "label": 1}\n{"premise": "b"}\n')],
                ":2: no field label",
            ),
            (lambda tmp, data: [bad_copa(tmp, "")], "validation.jsonl holds no rows: put the task's rows there"),
            (lambda tmp, data: ["device=cuda", f"data_dir={data}"], "device=cuda: no CUDA device on this machine"),
            (
                lambda tmp, data: ["results_dir=/sys/h2o_eval_results", f"data_dir={data}"],
                "results_dir=/sys/h2o_eval_results is not writable",
            ),
            (
                lambda tmp, data: ["task=lm_eval"],
                "task.name: a required setting without a value: give it on the command",
            ),
            (
                lambda tmp, data: ["task=niah_single_2", "task.length=100000", f"data_dir={data}"],
                "task.length=100000 exceeds tiny-llama's 2048 positions: use task.length <= 2048",
            ),
            (
                lambda tmp, data: ["task=niah_single_2", "+task.lenght=1024", f"data_dir={data}"],
                "task niah_single_2 takes no lenght (task.length?): its settings are depths, family, fit_tokenizer",
            ),
            (
                lambda tmp, data: ["task=xsum", "+task.max_new_tokens=8", f"data_dir={data}"],
                "task xsum takes no max_new_tokens: its settings are hub, name, runner, split, template",
            ),
            (
                lambda tmp, data: ["task=copa", f"+task.include_path={tmp}", f"data_dir={data}"],
                "task copa takes no include_path: its settings are lm_eval_yaml, metric, name, runner",
            ),
            (
                lambda tmp, data: ["task=gsm8k", "generation.max_new_tokens=0", f"data_dir={data}"],
                "task gsm8k does not read generation.max_new_tokens=0: set task.max_new_tokens instead",
            ),
            (
                lambda tmp, data: ["task=niah_single_1", "generation.sample=true", f"data_dir={data}"],
                "task niah_single_1 does not read generation.sample=True: drop it",
            ),
        ],
        lambda case: "takes no lenght" in case[1],
    ),
    ids=[
        "model-offline",
        "hub-task-offline",
        "malformed-line",
        "missing-field",
        "empty-file",
        "cuda",
        "read-only",
        "missing-mandatory",
        "beyond-positions",
        "unknown-task-key-long-context",
        "unknown-task-key-summarisation",
        "unknown-task-key-lm_eval",
        "generation-key-the-task-does-not-read",
        "sampling-a-task-that-does-not-sample",
    ],
)
def test_bad_input_is_one_line_before_any_model_and_leaves_nothing(tmp_path, data_dir, make_args, message):
    args = make_args(tmp_path, data_dir)
    before = set(tmp_path.rglob("*"))
    task = [] if any(arg.startswith("task=") for arg in args) else ["task=copa"]
    done = h2o_eval("model=tiny-llama", *task, *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
    assert done.stdout == "" and set(tmp_path.rglob("*")) == before  # no results/, no hydra/ folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("budget=1.5",), "error: budget=1.5: use a fraction in (0, 1]"),
        (("task=piqa", "rounding=sideways"), "error: rounding='sideways': use one of up, down"),
        (("task=niah_single_1", "threads=0"), "error: threads=0: use an integer >= 1"),
        (("task=xsum", "limit=0"), "error: limit=0: use a document count >= 1"),
    ],
)
def test_a_setting_checked_by_its_value_is_refused_before_torch_transformers_or_lm_eval_load(tmp_path, args, message):
    """Refused in one line with exit status 2, whatever the task's runner, without importing what takes seconds to
    import (``-X importtime`` lists every module the process imported)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "h2o_eval", *args, f"results_dir={tmp_path}"],
        cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), done.stderr[-2000:]
    assert not imported & {"torch", "transformers", "lm_eval.tasks", "datasets"}
    assert "h2o_eval.run" not in imported and "h2o_eval.checks" in imported


@pytest.mark.parametrize(
    "command", [pytest.param(["h2o_eval"], marks=pytest.mark.slow), ["h2o_eval.grid", "policy=full,h2o"]]
)
def test_ctrl_c_prints_one_line_of_what_is_kept_and_leaves_nothing_half_written(tmp_path, data_dir, command):
    """Ctrl-C while a long-context run answers: no traceback, one line that says what is kept and that the same
    command resumes, exit status 130, and no temporary or lock file left beside the records."""
    args = ["model=tiny-llama", "task=niah_single_1", "task.length=1500", "limit=200", "batch_size=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", *command[:1], *args, *command[1:], f"data_dir={data_dir}", "results_dir=out"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    said = ""
    while "answering niah_single_1" not in said:
        said += process.stderr.read(1) or pytest.fail(f"it ended before answering: {said[-2000:]}")
    process.send_signal(signal.SIGINT)
    said += process.stderr.read()
    assert process.wait(timeout=60) == 130
    assert "Traceback" not in said, said[-3000:]
    last = said.strip().splitlines()[-1]
    out = tmp_path / "out"
    assert last == (
        f"interrupted: the records in {out} are kept, whole, and a long-context run's finished batches under "
        f"{out}/partial/; run the same command again to resume"
    )
    assert not [path for path in (tmp_path / "out").rglob(".*") if path.suffix in (".tmp", ".lock")]
