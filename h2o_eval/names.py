"""The names a command line picks from the config groups (``model=``, ``task=``, ``policy=``, ``+experiment=``,
``+sweep=``), checked before Hydra composes anything: Hydra's own message for an unknown one is 26 lines and a
search path, this is one line that lists the names to use."""

from __future__ import annotations

from h2o_eval.conf import listed, options

GROUPS = ("model", "task", "policy", "experiment", "sweep")


def unknown_names(overrides: list[str]) -> list[str]:
    """One message per unknown name that ``overrides`` (command-line overrides, comma sweeps included) pick from
    a config group, in order: ``policy=nope: no policy of that name: use one of adakv, ...``. Overrides Hydra
    cannot parse are left to Hydra's own message."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return []
    found: dict[str, None] = {}
    for override in parsed:
        group = override.key_or_group
        # a glob picks among the options that exist; an interval picks no name
        skipped = (None, ValueType.GLOB_CHOICE_SWEEP, ValueType.INTERVAL_SWEEP)
        if group not in GROUPS or override.is_delete() or override.value_type in skipped:
            continue
        swept = override.is_sweep_override()
        values = override.sweep_string_iterator() if swept else [override.get_value_element_as_str()]
        known, key, names = options(group), override.get_key_element(), ", ".join(listed(group))
        for value in values:
            if value not in known and value != "null":  # null deselects a group's default
                found[f"{key}={value}: no {group} of that name: use one of {names}"] = None
    return list(found)
