"""Hydra callbacks: the closing summary of a sweep."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    """After ``--multirun``: how many jobs ran, were skipped (record existed) or failed, and why. A sweep with
    a failed job exits with status 1 once every job has had its turn."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        statuses = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/status.json"))]
        counts = Counter(s["status"] for s in statuses)
        print(f"sweep {sweep_dir}: {counts['ran']} ran, {counts['skipped']} skipped, {counts['failed']} failed")
        for status in statuses:
            if status["status"] == "failed":
                print(f"  failed: {status['overrides']}: {status['error']} (record: {status['failure_record']})")
        if counts["failed"]:
            sys.exit(1)
