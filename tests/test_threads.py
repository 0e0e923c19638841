"""The ``threads`` setting reaches torch, numba and the BLAS before the model loads, and is recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from h2o_eval import threads


@pytest.mark.slow
def test_threads_reach_torch_and_numba_in_a_run(tmp_path, data_dir):
    """A CLI run in its own process with ``threads=2`` (numba may use up to 4): the record holds what torch and
    numba report after the setting, where torch would otherwise follow OMP_NUM_THREADS=1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "4", "WANDB_MODE": "offline"}
    args = ("model=tiny-llama", "task=copa", "policy=full", "limit=2", f"data_dir={data_dir}", "results_dir=out")
    done = subprocess.run(
        [sys.executable, "-m", "h2o_eval", *args, "threads=2"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "out").glob("*.json")
    record = json.loads(path.read_text())
    assert record["threads"]["threads"] == 2 and record["config"]["threads"] == 2
    assert record["threads"]["torch"] == 2 and record["threads"]["numba"] == 2


def test_threads_are_not_part_of_a_records_identity(tmp_path):
    from conftest import make_config

    from h2o_eval import results

    one = make_config(None, tmp_path, model="tiny-llama", task="copa", threads=1)
    two = make_config(None, tmp_path, model="tiny-llama", task="copa", threads=2)
    assert results.record_path(tmp_path, one) == results.record_path(tmp_path, two)


def test_the_default_is_one_thread_unless_a_launcher_gave_the_job_cpus(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    ray = "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
    slurm = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert threads.default_threads(None) == 1
    assert threads.default_threads({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}) == 1
    assert threads.default_threads({"_target_": joblib, "n_jobs": 2}) == 1
    assert threads.default_threads({"_target_": ray, "ray": {"remote": {}}}) == 1
    assert threads.default_threads({"_target_": ray, "ray": {"remote": {"num_cpus": 3}}}) == 3
    assert threads.default_threads({"_target_": slurm, "cpus_per_task": None}) == 1
    assert threads.default_threads({"_target_": slurm, "cpus_per_task": 6}) == 6


def test_a_loaded_numba_keeps_compiling_after_the_setting(monkeypatch):
    """numba reads its ceiling once; changing NUMBA_NUM_THREADS after its threads started would make every later
    compilation fail. With numba loaded, the setting is capped at the ceiling and the environment left alone."""
    import numba
    import numpy as np
    import torch

    monkeypatch.setattr(os, "environ", os.environ.copy())  # the settings' variables end with the test
    before = torch.get_num_threads()
    ceiling = numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(ceiling)  # numba's threads are running
    try:
        applied = threads.apply(ceiling + 1)

        @numba.njit(parallel=True)
        def total(values):
            sum_ = 0.0
            for i in numba.prange(values.shape[0]):
                sum_ += values[i]
            return sum_

        assert total(np.ones(7)) == 7.0
        assert applied["numba"] == ceiling and applied["torch"] == ceiling + 1
    finally:
        threads.apply(before)
