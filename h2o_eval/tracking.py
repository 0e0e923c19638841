"""Weights & Biases logging. A W&B failure is reported and never costs the local record."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def log_run(settings: dict[str, Any], record: dict[str, Any], run_name: str, work_dir: Path) -> str | None:
    """Log ``record`` (config, metrics, key numbers) as one W&B run; returns its id, or None if not logged."""
    if settings["mode"] == "disabled":
        return None
    try:
        import wandb

        run = wandb.init(
            mode=settings["mode"],
            project=settings["project"],
            entity=settings["entity"],
            group=settings["group"],
            tags=list(settings["tags"]),
            name=run_name,
            config=record["config"],
            dir=str(work_dir),
            reinit="finish_previous",
        )
        run.summary.update(
            {**record["metrics"], "n_samples": record["n_samples"], "wall_seconds": record["wall_seconds"]}
        )
        run.finish()
        return run.id
    except Exception as error:  # noqa: BLE001 - any W&B failure must leave the run's result intact
        print(
            f"warning: W&B logging failed ({type(error).__name__}: {error}); the local record is kept",
            file=sys.stderr,
        )
        return None
