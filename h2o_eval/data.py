"""Local data files: reading them (one line naming the file, row and fix when they cannot be read) and what they
hold (a hash). Which files a run reads is its runner's to say (:meth:`h2o_eval.runners.Runner.data_files`).

A record's identity covers the content of its data (not the folder it came from), so a run on other data is
never reported with the numbers of an earlier one, and byte-identical copies share their records.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from h2o_eval.errors import ConfigError


def read_jsonl(path: Path, fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file, each a JSON object with the keys of the first row and ``fields``.

    A bad file stops the run with one line naming the file, the row and the fix, instead of a traceback from
    deep inside ``datasets`` or lm-eval once the model is loaded.
    """
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: not a JSON line ({error.msg}): fix or delete that line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: a JSON object per line is needed: fix or delete that line")
            expected = dict.fromkeys((*rows[0], *fields) if rows else fields)
            missing = [key for key in expected if key not in row]
            if missing:
                raise ConfigError(f"{path}:{number}: no field {', '.join(missing)}: add it or delete that line")
            rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no rows: put the task's rows there or change data_dir")
    return rows


def split_file(data_dir: str | Path, name: str, split: str) -> Path:
    """A task's split under ``data_dir``, ``<data_dir>/<name>/<split>.jsonl``; refused in one line if it is not
    there."""
    path = Path(data_dir) / name / f"{split}.jsonl"
    if not path.is_file():
        raise ConfigError(f"no data file {path}: put it there or change data_dir={data_dir}")
    return path


def first(total: int, limit: int | float | None) -> int:
    """How many of ``total`` documents a run's ``limit`` takes: all (None), a count, or a fraction of them."""
    if limit is None:
        return total
    return min(total, limit if isinstance(limit, int) else int(limit * total))


def fingerprint(files: list[Path]) -> str:
    """What a run's data is: ``hub`` when it reads no local file, else a hash of the content of the files."""
    if not files:
        return "hub"
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(content_hash(path.resolve(), stat.st_size, stat.st_mtime_ns).encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=64)
def content_hash(path: Path, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file's bytes, cached by (path, size, mtime): a file is read once per process unless it
    changes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
