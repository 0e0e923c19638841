"""``python -m h2o_eval model=... task=... policy=... budget=...``: the Hydra app."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from h2o_eval.errors import ConfigError
from h2o_eval.run import fail, run


@hydra.main(version_base="1.3", config_path="pkg://h2o_eval.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config = OmegaConf.to_container(cfg, resolve=True)
    for key in ("data_dir", "results_dir"):
        if config[key] is not None:
            config[key] = to_absolute_path(config[key])
    try:
        run(config, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as error:
        fail(error)


if __name__ == "__main__":
    main()
