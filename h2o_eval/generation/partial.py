"""A run's answers so far, kept on disk after every batch, so that a run stopped part way (a preempted job, a
machine taken back) resumes from its last finished batch instead of its first document.

:func:`~h2o_eval.generation.answering.answer` reads the file when it starts, writes it whole (a new file renamed
over the old) after each batch, and removes it when every batch is answered. The file holds each cell's
:class:`~h2o_eval.generation.answering.Answers` (rows and log), which batches are done, and what the runs before
spent, so that the record counts every run's time (``generation.resumed``). Its name is a hash of everything that
decides the answers (:func:`h2o_eval.results.partial_path`): a run of other settings never reads it.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Earlier:
    """What the runs before this one answered and spent: ``batches`` done, as (protocol, first unit); per cell its
    answers so far; their ``documents``; the CPU and wall seconds they spent answering (all cells); ``git``: the
    commit the first of them ran."""

    batches: set[tuple[str, int]] = field(default_factory=set)
    answers: list[Any] = field(default_factory=list)
    documents: int = 0
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    git: Any = None


class Partial:
    """The answers of one :func:`~h2o_eval.generation.answering.answer` so far at ``path`` (None: kept nowhere):
    :meth:`load` what a stopped run left, :meth:`save` after each batch, :meth:`finish` when all are answered."""

    def __init__(self, path: Path | None, git: Any = None) -> None:
        self.path, self.git = path, git
        self.earlier = Earlier(git=git)
        self.began_cpu, self.began_wall = time.process_time(), time.perf_counter()

    def load(self, cells: int) -> Earlier:
        """What a stopped run of these settings left (nothing if none did, or if its file holds another number
        of cells)."""
        if self.path is not None and self.path.exists():
            earlier = pickle.loads(self.path.read_bytes())
            if isinstance(earlier, Earlier) and len(earlier.answers) == cells:
                self.earlier = earlier
        return self.earlier

    def save(self, batches: set[tuple[str, int]], answers: list[Any], documents: int) -> None:
        """Keep the answers after a batch: the whole file or none of it (a new file renamed over the old)."""
        if self.path is None:
            return
        earlier = Earlier(set(batches), answers, documents, self.cpu_seconds(), self.wall_seconds(), self.earlier.git)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        temporary.write_bytes(pickle.dumps(earlier))
        os.replace(temporary, self.path)

    def cpu_seconds(self) -> float:
        """The CPU seconds spent answering, this run's and the runs' before."""
        return self.earlier.cpu_seconds + time.process_time() - self.began_cpu

    def wall_seconds(self) -> float:
        return self.earlier.wall_seconds + time.perf_counter() - self.began_wall

    def finish(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
