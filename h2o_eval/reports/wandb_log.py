"""A report logged to Weights & Biases: its figures and its table as one run in a sweep's group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from h2o_eval.reports.tables import COLUMNS


def log_to_wandb(rows: list[dict[str, Any]], files: list[Path], group: str, project: str, mode: str) -> None:
    """Log the figures and the table as one W&B run in ``group`` (a sweep's runs share its folder's name)."""
    import wandb

    run = wandb.init(project=project, group=group, job_type="plot", mode=mode, name=f"{group}-plots")
    run.log(
        {
            **{f"figures/{path.stem}": wandb.Image(str(path)) for path in files if path.suffix == ".png"},
            "summary": wandb.Table(columns=list(COLUMNS), data=[[row[c] for c in COLUMNS] for row in rows]),
        }
    )
    run.finish()
