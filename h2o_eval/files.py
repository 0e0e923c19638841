"""Writing a file so that readers see either nothing or the whole of it: the results store's records and outputs,
and a run's partial answers, share it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes) to ``path`` through a synced temporary file renamed over it; temporary files a
    process killed mid-write left beside it are removed first. The file is readable as the umask allows, not
    mkstemp's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.stem}.*.tmp"):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide records from the rest of a group
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
