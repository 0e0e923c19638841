"""A committed board's records packed as one file: ``records.jsonl.gz`` in the folder the records were in.

A run writes one JSON record (and its ``.outputs.jsonl``) per setting, atomically, and resumes by finding them
(:mod:`h2o_eval.results`). A finished board is then packed, ``python -m h2o_eval.results pack DIR``: one gzip
compressed JSON Lines file, a line per record, sorted by file name. Each line is the record as it was written, plus
``file`` (its file name) and ``rows`` (its per-question outputs, where it has them). Pandas reads it as it is:

    records = pandas.read_json("records.jsonl.gz", lines=True)

A folder may hold a pack and loose records side by side (a board resumed after packing): readers take both, a loose
file over a packed one of the same name, and packing again folds the loose ones in.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

from h2o_eval.files import atomic_write

PACK = "records.jsonl.gz"
OUTPUTS_SUFFIX = ".outputs.jsonl"
PACK_KEYS = ("file", "rows")  # what a pack's line adds to its record


def pack_of(folder: str | Path) -> Path:
    return Path(folder) / PACK


def entries(folder: str | Path) -> dict[str, dict[str, Any]]:
    """The records packed in ``folder`` by file name, each with its ``rows`` (absent without outputs); empty
    without a pack. Read once per version of the file (its inode, time and size: a pack is replaced, never
    rewritten in place)."""
    path = pack_of(folder)
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {}
    return _read(str(path.resolve()), (stat.st_ino, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _read(path: str, version: tuple[int, int, int]) -> dict[str, dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle]
    return {line["file"]: line for line in lines}


def record(entry: dict[str, Any]) -> dict[str, Any]:
    """A pack's line as the record its file held."""
    return {key: value for key, value in entry.items() if key not in PACK_KEYS}


def outputs_path(record: Path) -> Path:
    """The per-document outputs of a run (each document's id and scores, and what a runner adds), next to its
    record."""
    return record.with_name(record.stem + OUTPUTS_SUFFIX)


def outputs(path: Path) -> list[dict[str, Any]] | None:
    """The per-question rows of the outputs file ``path``: the file, or its record's rows in the pack beside it;
    None where neither is."""
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines()]
    name = path.name.removesuffix(OUTPUTS_SUFFIX) + ".json"
    entry = entries(path.parent).get(name)
    return None if entry is None or "rows" not in entry else entry["rows"]


def write(folder: Path, records: dict[str, dict[str, Any]], rows: dict[str, list[dict[str, Any]]]) -> Path:
    """Write ``folder``'s pack of ``records`` by file name, each with its ``rows`` where it has them: atomically,
    and byte for byte the same for the same records (sorted, no time stamp in the gzip header)."""
    lines = []
    for name in sorted(records):
        if clash := [key for key in PACK_KEYS if key in records[name]]:
            raise ValueError(f"{folder / name} holds {', '.join(clash)}, which a pack's line adds: not packed")
        line = {**records[name], "file": name} | ({"rows": rows[name]} if name in rows else {})
        lines.append(json.dumps(line, sort_keys=True, separators=(",", ":"), default=str))
    data = gzip.compress("".join(line + "\n" for line in lines).encode(), compresslevel=9, mtime=0)
    atomic_write(pack_of(folder), data)
    return pack_of(folder)
