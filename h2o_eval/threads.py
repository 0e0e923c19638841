"""CPU threads per job: torch, numba and the BLAS limited before the model loads, so parallel jobs share the
cores instead of each taking all of them."""

from __future__ import annotations

import os
import sys
from typing import Any

# Read by OpenMP, the BLAS builds and numexpr when they load: libraries a job loads later follow the setting.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: a Slurm allocation, a container's share)."""
    return len(os.sched_getaffinity(0))


def default_threads(launcher: dict[str, Any] | None) -> int:
    """The threads of one job when ``threads`` is unset: the CPUs its launcher gave it (the task's ``num_cpus``
    under the Ray launcher, Ray's default 1; ``cpus_per_task`` under submitit's Slurm and local launchers), else
    one. A model of this project's size gains little from a second thread (SmolLM2 on COPA, 2 idle cores: 1.26x)
    and loses much when other work shares the cores (beside two busy processes: 1.6x slower than one thread), as
    threads that wait on each other spin; parallel jobs (joblib's ``n_jobs``, a grid's lanes) take the cores
    instead."""
    launcher = launcher or {}
    name = str(launcher.get("_target_", "")).rsplit(".", 1)[-1]
    if name == "RayLauncher":
        return int((launcher.get("ray") or {}).get("remote", {}).get("num_cpus") or 1)
    if name in ("SlurmLauncher", "LocalLauncher"):
        return int(launcher.get("cpus_per_task") or 1)
    return 1


def apply(threads: int) -> dict[str, Any]:
    """Use ``threads`` threads in torch, numba and the BLAS (through threadpoolctl, and the environment for
    libraries loaded later). Returns what each library reports afterwards."""
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(threads)
    if "numba" not in sys.modules:  # numba's ceiling, read once on import; changed later, numba refuses to compile
        os.environ["NUMBA_NUM_THREADS"] = str(threads)
    import numba
    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    applied: dict[str, Any] = {"threads": threads, "torch": torch.get_num_threads(), "numba": numba.get_num_threads()}
    threadpool_limits(limits=threads)
    applied["blas"] = sorted({pool["num_threads"] for pool in threadpool_info()})
    return applied
