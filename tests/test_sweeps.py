"""Sweeps: every launcher ends with exactly the expected records; killed sweeps resume; failures are kept."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

SWEEP = ("model=tiny-llama", "task=copa,rte", "policy=full,h2o", "budget=0.2,0.5", "limit=4", "batch_size=4")
# full ignores the budget: one record per task; h2o: one per task and budget.
EXPECTED = {
    (task, policy, budget) for task in ("copa", "rte") for policy, budget in [("full", 1.0), ("h2o", 0.2), ("h2o", 0.5)]
}


def sweep(*args: str, cwd, wait: bool = True):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "h2o_eval", "--multirun", *args]
    if not wait:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def records(results_dir):
    found = [json.loads(p.read_text()) for p in results_dir.glob("*.json")]
    return [(r["task"], r["policy"], r["budget"]) for r in found]


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher",
    [("hydra/launcher=joblib", "hydra.launcher.n_jobs=2"), ("hydra/launcher=submitit_local",)],
    ids=["joblib", "submitit_local"],
)
def test_a_sweep_through_a_launcher_writes_each_record_once(tmp_path, data_dir, launcher):
    done = sweep(*SWEEP, *launcher, f"data_dir={data_dir}", "results_dir=out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = records(tmp_path / "out")
    assert sorted(found) == sorted(EXPECTED)
    assert "6 ran, 2 skipped, 0 failed" in done.stdout
    threads = {json.loads(p.read_text())["threads"]["threads"] for p in (tmp_path / "out").glob("*.json")}
    assert threads == {1}  # one per job: neither launcher gave the jobs CPUs


@pytest.mark.slow
def test_a_ray_sweep_writes_the_records_of_the_basic_launcher(tmp_path, data_dir):
    """Reference: the basic launcher (jobs in turn, in the sweep's process); implementation: hydra/launcher=ray
    on a local Ray instance that the sweep starts (two workers) and that ends with it."""
    args = ("model=tiny-llama", "task=copa", "policy=full,h2o", "limit=4", "batch_size=4", f"data_dir={data_dir}")
    basic = sweep(*args, "results_dir=basic", cwd=tmp_path)
    assert basic.returncode == 0, basic.stdout[-3000:] + basic.stderr[-3000:]
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    ray = sweep(
        *args,
        "results_dir=ray",
        "hydra/launcher=ray",
        "+hydra.launcher.ray.init.num_cpus=2",
        "+hydra.launcher.ray.init.include_dashboard=false",
        f"+hydra.launcher.ray.init._temp_dir={ray_dir}",
        cwd=tmp_path,
    )
    assert ray.returncode == 0, ray.stdout[-3000:] + ray.stderr[-3000:]
    assert "Ray Launcher is launching 2 jobs" in ray.stdout + ray.stderr
    assert "2 ran, 0 skipped, 0 failed" in ray.stdout
    assert list(Path(ray_dir).glob("session_*/logs/worker-*.out")), "no Ray worker ran a job"
    left = [proc.parent.name for proc in Path("/proc").glob("[0-9]*/cmdline") if ray_dir in _read(proc)]
    assert not left, f"Ray processes outlived the sweep: {left}"
    shutil.rmtree(ray_dir, ignore_errors=True)
    expected = {p.name: json.loads(p.read_text()) for p in (tmp_path / "basic").glob("*.json")}
    got = {p.name: json.loads(p.read_text()) for p in (tmp_path / "ray").glob("*.json")}
    assert got.keys() == expected.keys() and len(got) == 2
    for name, record in got.items():
        assert record["metrics"] == expected[name]["metrics"] and record["capacity"] == expected[name]["capacity"]
        assert record["threads"]["threads"] == 1  # Ray's task default: one CPU per job


@pytest.mark.slow
def test_a_sweep_killed_mid_run_resumes_with_only_what_is_missing(tmp_path, data_dir):
    args = (*SWEEP, f"data_dir={data_dir}", "results_dir=out")
    process = sweep(*args, cwd=tmp_path, wait=False)
    deadline = time.monotonic() + 600
    while len(list((tmp_path / "out").glob("*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = set(records(tmp_path / "out"))
    assert 2 <= len(before) < len(EXPECTED), "the sweep was not killed mid-way: the test proves nothing"

    done = sweep(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert sorted(records(tmp_path / "out")) == sorted(EXPECTED)
    ran = len(EXPECTED) - len(before)
    assert f"{ran} ran, {8 - ran} skipped, 0 failed" in done.stdout
    assert not list((tmp_path / "out").glob(".*.tmp"))


@pytest.mark.slow
def test_a_failing_job_is_recorded_the_others_run_and_a_fixed_rerun_removes_its_failure(tmp_path, data_dir):
    local = tmp_path / "data"
    local.mkdir()
    (local / "copa").symlink_to(data_dir / "copa")  # rte's data is missing
    args = ("model=tiny-llama", "task=copa,rte", "policy=h2o", "limit=4", f"data_dir={local}", "results_dir=out")
    args += ("on_error=skip",)
    done = sweep(*args, cwd=tmp_path)
    assert done.returncode == 1
    assert "1 ran, 0 skipped, 1 failed" in done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("  failed: ")]
    assert "task=rte" in line and "no data file" in line
    assert records(tmp_path / "out") == [("copa", "h2o", 0.2)]
    (failure,) = (tmp_path / "out" / "failed").glob("*.json")
    saved = json.loads(failure.read_text())
    assert saved["error"].startswith("ConfigError: no data file") and saved["config"]["task"]["name"] == "rte"

    (local / "rte").symlink_to(data_dir / "rte")  # fixed: the rerun computes rte and its failure record goes
    again = sweep(*args, cwd=tmp_path)
    assert again.returncode == 0 and "1 ran, 1 skipped, 0 failed" in again.stdout, again.stdout[-3000:]
    assert not failure.exists()


@pytest.mark.parametrize(
    ("args", "lines"),
    [
        (
            ["budget=0.2,1.5"],
            ["error: budget=1.5: use a fraction in (0, 1]"],
        ),
        (
            ["task=copa,rte", "budget=0.2,1.5", "protocol=simulate,prefill"],
            [
                "error: task=copa protocol=simulate: budget=1.5: use a fraction in (0, 1]",
                "error: task=copa protocol=prefill: budget=1.5: use a fraction in (0, 1]",
                "error: task=rte protocol=simulate: budget=1.5: use a fraction in (0, 1]",
                "error: task=rte protocol=prefill: budget=1.5: use a fraction in (0, 1]",
            ],
        ),
        (
            ["+budget=0.3,0.5"],
            [
                "error: +budget=0.3: Could not append to config. An item is already at 'budget'.",
                "error: +budget=0.5: Could not append to config. An item is already at 'budget'.",
            ],
        ),
    ],
    ids=["one-bad-job", "four-bad-jobs", "jobs-hydra-cannot-compose"],
)
def test_an_invalid_job_stops_the_sweep_before_any_job_runs(tmp_path, data_dir, args, lines):
    """Every job is checked before the first runs: one line per invalid job, exit status 2, and nothing written
    (no record, no failure record, no Hydra folder), so the valid jobs have not run either."""
    done = sweep("model=tiny-llama", "task=copa", "policy=h2o", *args, "limit=2", f"data_dir={data_dir}",
                 "results_dir=out", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    found = done.stderr.strip().splitlines()
    assert len(found) == len(lines) and all(line.startswith(start) for line, start in zip(found, lines, strict=True))
    assert done.stdout == "" and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_under_on_error_skip_an_invalid_job_is_a_failed_line_and_a_record_the_others_run(tmp_path, data_dir):
    """budget=1.5 builds no policy, so no record name: the job is still recorded under failed/ (with its
    traceback), named from its settings as given, and the sweep still ends with its summary."""
    done = sweep(
        "model=tiny-llama",
        "task=copa",
        "policy=h2o",
        "budget=0.2,1.5",
        "limit=2",
        f"data_dir={data_dir}",
        "results_dir=out",
        "on_error=skip",
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert "failed: ConfigError: budget=1.5: use a fraction in (0, 1]" in done.stdout
    assert "1 ran, 0 skipped, 1 failed" in done.stdout
    assert records(tmp_path / "out") == [("copa", "h2o", 0.2)]
    (failure,) = (tmp_path / "out" / "failed").glob("*.json")
    assert failure.name.startswith("tiny-llama__copa__h2o__b1.5__simulate__0shot__")
    assert f"(record: {failure})" in done.stdout
    saved = json.loads(failure.read_text())
    assert saved["error"].startswith("ConfigError: budget=1.5") and saved["config"]["budget"] == 1.5
    assert "ConfigError" in saved["traceback"][-1]


def test_a_job_whose_task_default_cannot_resolve_is_a_failed_job(tmp_path):
    """The task's default protocol comes from its lm-eval YAML, which a missing include path cannot give: the job
    is refused before the sweep runs, or, under on_error=skip, fails like any other, its unresolved settings
    recorded as null."""
    args = ("model=tiny-llama", "task=lm_eval", "task.name=mine", "task.include_path=nowhere", "results_dir=out")
    stopped = sweep(*args, cwd=tmp_path)
    assert stopped.returncode == 2 and stopped.stderr.startswith("error: task.include_path="), stopped.stderr
    done = sweep(*args, "on_error=skip", cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert "failed: ConfigError: task.include_path=" in done.stdout and "0 ran, 0 skipped, 1 failed" in done.stdout
    (failure,) = (tmp_path / "out" / "failed").glob("*.json")
    saved = json.loads(failure.read_text())
    assert saved["config"]["protocol"] is None and saved["config"]["task"]["name"] == "mine"


def _read(path: Path) -> str:
    """A file of /proc, or "" if its process ended meanwhile."""
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:
        return ""
