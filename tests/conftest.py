"""Shared fixtures. Tests never touch the network: hub and W&B are offline, data comes from shared/data."""

from __future__ import annotations

import os
from pathlib import Path

# No GPU on any machine of this project: Triton kernels run in Triton's interpreter (set before they are defined).
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "TRITON_INTERPRET": "1",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("H2O_EVAL_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "copa" / "validation.jsonl").is_file():
        pytest.fail(f"task data not found under {DATA_DIR}: set H2O_EVAL_DATA to the shared/data folder")
    return DATA_DIR


def make_config(data_dir: Path | None, results_dir: Path, **overrides) -> dict:
    """A resolved run config as the CLI would build it, composed by Hydra from conf/ with ``overrides``."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    args = [f"{key}={value}" for key, value in overrides.items()]
    args += [f"results_dir={results_dir}", "wandb.mode=disabled"]
    if data_dir is not None:
        args.append(f"data_dir={data_dir}")
    with initialize_config_module(config_module="h2o_eval.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=args)
    return OmegaConf.to_container(cfg, resolve=True)
