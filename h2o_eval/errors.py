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
