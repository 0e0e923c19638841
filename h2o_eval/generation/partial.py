"""A run's answers so far, kept on disk after every batch, so that a run stopped part way (a preempted job, a
machine taken back) resumes from its last finished batch instead of its first document, on this machine or on
another that has the file.

:func:`~h2o_eval.generation.answering.answer` takes up what the file holds when it starts and writes it whole (a
new file renamed over the old) after each batch; the run that writes the records removes it after them
(:func:`h2o_eval.run.compute`). The file is JSON: each cell's answers (rows and log, as
:meth:`~h2o_eval.generation.answering.Answers.state` gives them) under its record's name, the batch size and which
batches are done, and what the runs before spent, so that the record counts every run's time
(``generation.resumed``). Reading it runs no code, so a file from another machine (a results folder committed part
way) is safe to take up. Its name is a hash of the cells' record names and of the settings outside their identity
that may change an answer (:func:`h2o_eval.results.partial_path`), not of where the results go: a run of other
settings never reads it. A file that cannot be read, or that holds other cells, larger batches than fit now, or
answers computed on another device or with another number of threads (``device=auto`` and ``threads`` unset
resolve differently on different machines), is started over, with a line that says so.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h2o_eval.files import atomic_write

VERSION = 2  # of the file's layout (1: a pickle, under another name): a file of another is started over


@dataclass
class Earlier:
    """What the runs before this one answered and spent: per cell (``names``: the records', in the order of
    ``answers``) its answers so far, as JSON's types; ``size``: the documents (or prompts) they answered a batch;
    ``batches`` done, as (protocol, first unit); the CPU and wall seconds they spent answering (all cells); ``git``:
    the commit the first of them ran; ``made``: the device and threads they ran on (None: not said)."""

    names: list[str]
    size: int
    batches: set[tuple[str, int]]
    answers: list[Any]
    cpu_seconds: float
    wall_seconds: float
    git: Any
    made: dict[str, Any] | None


class Partial:
    """The answers so far of the cells ``names`` (their records' file names, in the order they are answered) at
    ``path`` (None: kept nowhere): :meth:`load` what a stopped run left, :meth:`save` after each batch,
    :meth:`finish` once the records are written. ``git``: this run's commit; ``made``: the device and threads it
    runs on, resolved (``{"device": "cpu", "threads": 1}``)."""

    def __init__(
        self, path: Path | None, names: list[str] | None = None, git: Any = None, made: dict[str, Any] | None = None
    ) -> None:
        self.path, self.names, self.git, self.made = path, list(names or []), git, made
        self.earlier: Earlier | None = None
        self.began_cpu, self.began_wall = time.process_time(), time.perf_counter()

    def load(self, size: int) -> Earlier | None:
        """What a stopped run of these cells left, its answers in this run's order: None where there is nothing
        to take up, or where the file cannot be read, holds other cells or answered more than ``size`` (the
        batch that fits now) a batch (then it is started over, with a line that says why)."""
        if self.path is None:
            return None
        if (pickled := self.path.with_suffix(".pkl")).exists():  # layout 1: not read, as it could run code
            print(f"partial answers {pickled} kept by an older h2o_eval: starting over", file=sys.stderr, flush=True)
            pickled.unlink()
        if not self.path.exists():
            return None
        try:
            kept = json.loads(self.path.read_text())
            reason = None
            if kept.get("version") != VERSION:
                reason = "written by another version of h2o_eval"
            else:
                batches = {(protocol, first) for protocol, first in kept["batches"]}
                earlier = Earlier(
                    kept["names"], kept["size"], batches, kept["answers"], kept["cpu_seconds"],
                    kept["wall_seconds"], kept["git"], kept["made"],
                )  # fmt: skip
                if sorted(earlier.names) != sorted(self.names):
                    reason = "of other cells"
                elif earlier.size > size:
                    reason = f"answered {earlier.size} a batch, and {size} fit now"
                elif None not in (earlier.made, self.made) and earlier.made != self.made:
                    reason = f"answered with {_made(earlier.made)}, and this run has {_made(self.made)}"
        except Exception as error:  # a file cut short, or not of this layout
            reason = f"unreadable ({type(error).__name__}: {error})"
        if reason is not None:
            print(f"partial answers {self.path} {reason}: starting over", file=sys.stderr, flush=True)
            return None
        earlier.answers = [earlier.answers[earlier.names.index(name)] for name in self.names]
        earlier.names = list(self.names)
        self.earlier = earlier
        return earlier

    def save(self, size: int, batches: set[tuple[str, int]], answers: list[Any]) -> None:
        """Keep the answers after a batch (each cell's, as JSON's types, in the order of ``names``): the whole file
        or none of it (a new file, synced, renamed over the old)."""
        if self.path is None:
            return
        kept = {
            "version": VERSION,
            "names": self.names,
            "size": size,
            "batches": sorted(batches),
            "answers": answers,
            "cpu_seconds": self.cpu_seconds(),
            "wall_seconds": self.wall_seconds(),
            "git": self.earlier.git if self.earlier is not None else self.git,
            "made": self.made,
        }
        atomic_write(self.path, json.dumps(kept))

    def cpu_seconds(self) -> float:
        """The CPU seconds spent answering, the runs' before and this one's."""
        before = self.earlier.cpu_seconds if self.earlier is not None else 0.0
        return before + time.process_time() - self.began_cpu

    def wall_seconds(self) -> float:
        before = self.earlier.wall_seconds if self.earlier is not None else 0.0
        return before + time.perf_counter() - self.began_wall

    def finish(self) -> None:
        """Remove the file, and its folder once empty: the records it was kept for are written."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            with suppress(OSError):  # other cells' answers are still kept there
                self.path.parent.rmdir()


def _made(made: dict[str, Any]) -> str:
    """``{"device": "cpu", "threads": 1}`` as "cpu, 1 thread"."""
    threads = made.get("threads")
    return f"{made.get('device')}, {threads} thread" + ("s" if threads != 1 else "")
