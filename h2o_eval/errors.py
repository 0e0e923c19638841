"""The one exception type for bad input: its message is a single line that names the fix; and how a command stops
on it."""

from __future__ import annotations

import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A setting, name or file the user gave cannot work; raised before any model is loaded."""


def fail(*errors: ConfigError | str) -> NoReturn:
    """Stop with one line ``error: ...`` per error and exit status 2 (bad input)."""
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


def interrupted(results_dir: object) -> NoReturn:
    """Stop on Ctrl-C with one line saying what is kept (records are written whole or not at all; a long-context
    group keeps its finished batches' answers under ``partial/``) and that the same command resumes; exit status
    130, as a shell reports an interrupted command."""
    # on a line of its own: a progress bar may be half drawn (a terminal's line is cleared, a log's ended)
    start = "\r\033[K" if sys.stderr.isatty() else "\n"
    print(
        f"{start}interrupted: the records in {results_dir} are kept, whole, and a long-context run's finished batches "
        f"under {results_dir}/partial/; run the same command again to resume",
        file=sys.stderr,
    )
    sys.exit(130)
