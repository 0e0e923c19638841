"""The names a command line picks from the config groups (``model=``, ``task=``, ``policy=``, ``+experiment=``,
``+sweep=``) and the keys it sets, checked before any model or library of the evaluation loads: Hydra's own message
for an unknown name is 26 lines and a search path, and for an unknown key 7 lines that advise adding it with
``+``; these are one line each, naming what to use."""

from __future__ import annotations

import difflib
import re

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


def expand(overrides: list[str]) -> list[list[str]]:
    """The sweep's jobs, each a list of plain overrides, in Hydra's ``--multirun`` order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)[0]


def compose(overrides: list[str], hydra: bool = False):
    """The config one job's ``overrides`` compose (with Hydra's own part where ``hydra``), as the CLI composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="h2o_eval.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


def _closest(key: str, known) -> str:
    found = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    return f"did you mean {found[0]}?" if found else f"use one of {', '.join(sorted(known))}"


def unknown_keys(overrides: list[str]) -> list[str]:
    """One message for a key ``overrides`` set that the config does not define, with or without ``+``: a top-level
    key (``budjet=0.2``, ``+budjet=0.2``), or a key of a group's chosen option (``task.lenght=5``), naming the
    closest known key. A key added with ``+`` inside a group is left to that group's own check (a task's settings,
    a policy's parameters). Overrides Hydra cannot parse or compose for another reason are left to Hydra."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        job = expand(overrides)[0]
    except HydraException:
        return []
    try:
        config = compose([o for o in job if not _adds_top_level(o)])
    except HydraException as error:
        missing = re.search(r"Could not override '([^']+)'", str(error))
        if missing is None:
            return []
        key = missing.group(1)
        given = next((o for o in job if o.lstrip("+~").split("=", 1)[0] == key), None)
        if given is None:  # not the command line's: Hydra's own message
            return []
        parent, _, leaf = key.rpartition(".")
        try:
            base = compose([o for o in job if o != given and not o.startswith("+")])
        except HydraException:
            return []
        node = OmegaConf.select(base, parent) if parent else base
        known = list(node.keys()) if node is not None and OmegaConf.is_dict(node) else []
        where = f"{parent} has" if parent else "the config has"
        return [f"{given}: {where} no setting {leaf!r}: {_closest(leaf, known)}"]
    known = set(config.keys())
    for override in filter(_adds_top_level, job):
        key = override.lstrip("+").split("=", 1)[0]
        if key not in known:
            return [f"{override}: the config has no setting {key!r}: {_closest(key, known)}"]
    return []


def _adds_top_level(override: str) -> bool:
    """Whether ``override`` adds a top-level key (``+budjet=1``), not a group's option (``+experiment=...``)."""
    added = re.match(r"\+\+?([^./=]+)=", override)
    return added is not None and added.group(1) not in GROUPS
