"""Weights & Biases logging. A W&B failure is reported in one line and never costs the local record, nor more
than ``wandb.init_timeout`` seconds (plus W&B's own teardown) when W&B online does not answer. What W&B prints
(its run's folder, its summary, how to sync it) goes to this module's logger, which ``conf/config.yaml`` sends to
the run's log file and not to the terminal."""

from __future__ import annotations

import io
import logging
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

from h2o_eval.hub import no_connection

log = logging.getLogger(__name__)


def log_run(settings: dict[str, Any], record: dict[str, Any], run_name: str, work_dir: Path) -> str | None:
    """Log ``record`` (config, metrics, key numbers) as one W&B run; returns its id, or None if not logged."""
    if settings["mode"] == "disabled":
        return None
    try:
        import wandb

        options = wandb.Settings(init_timeout=settings["init_timeout"])
        # W&B's server as its environment and settings files name it; without a connection, fail at once
        if settings["mode"] == "online" and (reason := no_connection(wandb.setup().settings.base_url)):
            raise ConnectionError(reason)
        printed = io.StringIO()
        try:
            with redirect_stdout(printed), redirect_stderr(printed):
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
                    settings=options,
                )
                run.summary.update(
                    {**record["metrics"], "n_samples": record["n_samples"], "wall_seconds": record["wall_seconds"]}
                )
                run.finish()
        finally:
            for line in printed.getvalue().splitlines():
                log.info(line)
        return run.id
    except Exception as error:  # noqa: BLE001 - any W&B failure must leave the run's result intact
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(
            f"warning: W&B logging failed ({type(error).__name__}: {reason}); the local record is kept "
            f"(W&B online gets wandb.init_timeout={settings['init_timeout']} s; wandb.mode=offline logs locally)",
            file=sys.stderr,
        )
        return None
