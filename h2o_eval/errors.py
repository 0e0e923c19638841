"""The one exception type for bad input: its message is a single line that names the fix."""


class ConfigError(ValueError):
    """A setting, name or file the user gave cannot work; raised before any model is loaded."""
