"""What sets a run apart: the settings a record's name, its summary line and every report spell out.

Every report names a run's model, task, policy, budget, protocol, shots and documents. Any other setting that
changes the numbers (a policy parameter, ``decoding``, ``rounding``, the questions per context, a task or
generation setting, the seed, the dtype) is a *departure* when it differs from its default: from
``conf/config.yaml``, the task's ``conf/task/<name>.yaml``, and the policy that ``conf/policy/<name>.yaml`` builds
at the same budget. Two records whose settings differ this way never read alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

import yaml

from h2o_eval.conf import options
from h2o_eval.errors import ConfigError

# Top-level settings that are part of a run's identity and named by every report already, or not settings at all.
NAMED = ("model", "task", "policy", "budget", "protocol", "num_fewshot", "limit", "data")
# Task settings named with the task: its name and runner, and the prompt length of a long-context task.
TASK_NAMED = ("name", "runner", "length")


@cache
def _config_defaults() -> dict[str, Any]:
    return yaml.safe_load((resources.files("h2o_eval.conf") / "config.yaml").read_text())


@cache
def _group(name: str) -> dict[str, dict[str, Any]]:
    """A config group's options (read once: a report labels every record it reads)."""
    return options(name)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted keys (``{"base": {"window": 8}}`` -> ``{"base.window": 8}``)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def policy_departures(built: Mapping[str, Any]) -> dict[str, Any]:
    """The built policy's parameters (``Policy.describe()``) that its YAML's policy at the same budget and rounding
    would not have, as ``policy.<name>`` (a wrapped base's as ``policy.base.<name>``; ``policy.base.name`` when the
    base differs), the keys the command line sets them with. A wrapper over another base than its YAML's (a
    threshold's ``dms`` over any policy, ``adakv`` over ``compactor``) is held against its YAML with that base at the
    base's own YAML parameters, so that only ``policy.base.name`` and what departs from both depart. A policy that
    its YAML cannot build (a record made under other defaults) departs in every parameter."""
    from h2o_eval.policies import POLICIES, make_policy

    params = _group("policy").get(built["name"], {})
    base = built.get("base")
    usual_base = params.get("base") or getattr(POLICIES.get(built["name"]), "default_base_name", None)
    other_base = isinstance(base, Mapping) and base["name"] != usual_base
    if other_base:
        own = {key: value for key, value in params.items() if key not in ("name", "base")}
        params = {**_group("policy").get(base["name"], {}), **own, "base": base["name"]}
    try:
        default = make_policy(
            built["name"], built.get("budget", 1.0), rounding=built.get("rounding", "up"),
            **{key: value for key, value in params.items() if key != "name"},
        ).describe()  # fmt: skip
    except ConfigError:
        default = {}
    own, usual = flatten(built), flatten(default)
    ignored = ("name", "budget", "rounding")
    found = {
        f"policy.{key}": value
        for key, value in own.items()
        if key.rsplit(".", 1)[-1] not in ignored or key == "base.name"
        if key not in usual or usual[key] != value
    }
    if other_base:
        found["policy.base.name"] = base["name"]
    return found


def departures(config: Mapping[str, Any], built_policy: Mapping[str, Any]) -> dict[str, Any]:
    """A run's settings that differ from their defaults (see the module), besides what every report names, as
    dotted keys: the policy's parameters as :func:`policy_departures` gives them (``window``), the task's
    (``task.questions``), ``decoding`` (never under ``simulate``, where nothing is compressed), under
    ``protocol=turns`` its ``turns.*`` settings and under ``decoding=interval`` its ``interval.*`` settings (a
    ``target_size`` that is the budget, in tokens, is named as the budget), ``rounding``, ``seed``, ``dtype`` and
    summarisation's ``generation.*``."""
    from h2o_eval.runners import runner_of

    found = policy_departures(built_policy)
    defaults = _config_defaults()
    extra = runner_of(config["task"]).identity(config)
    for key in ("rounding", "decoding", "interval", "turns", "seed", "dtype", *extra):
        if key == "decoding" and config.get("protocol") == "simulate":
            continue
        if key == "interval" and config.get("decoding") != "interval":
            continue
        if key == "turns" and config.get("protocol") != "turns":
            continue
        value = extra.get(key, config.get(key))
        if isinstance(value, Mapping):
            usual = flatten(defaults.get(key) or {}, f"{key}.")
            found |= {
                k: v
                for k, v in flatten(value, f"{key}.").items()
                if usual.get(k) != v and not (k == "interval.target_size" and v == config.get("budget"))
            }
        elif key in defaults and value != defaults[key]:
            found[key] = value
    task = config["task"]
    usual = _group("task").get(task["name"], {})
    found |= {
        f"task.{key}": value
        for key, value in task.items()
        if key not in TASK_NAMED and key != "include_path" and (key not in usual or usual[key] != value)
    }
    return found


def questions(config: Mapping[str, Any]) -> int | None:
    """The questions a long-context run asks per context (None for tasks without contexts)."""
    return config["task"].get("questions") if config["task"].get("runner") == "long_context" else None


def questions_label(count: int) -> str:
    return f"{count} question{'s' if count != 1 else ''} per context"


def label(key: str, value: Any) -> str:
    """One departure as a report shows it: ``window=8`` (a policy parameter), ``decoding=grow``, ``4 questions
    per context``."""
    if key == "task.questions":
        return questions_label(value)
    return f"{key.removeprefix('policy.')}={value}"


def labels(found: Mapping[str, Any]) -> list[str]:
    """The departures of :func:`departures` as report labels, policy parameters first."""
    order = sorted(found, key=lambda key: not key.startswith("policy."))
    return [label(key, found[key]) for key in order]


def _applies(key: str, config: Mapping[str, Any]) -> bool:
    """Whether a departure's key is a setting of this run at all: a task setting of a task that has it, the
    decoding rule of a protocol that compresses."""
    if key.startswith("task."):
        return key.removeprefix("task.") in config["task"]
    if key.startswith("interval."):
        return config.get("decoding") == "interval"
    if key.startswith("turns."):
        return config.get("protocol") == "turns"
    return key != "decoding" or config.get("protocol") != "simulate"


def report_labels(
    configs: list[Mapping[str, Any]], built: list[Mapping[str, Any]]
) -> tuple[list[dict[str, str]], list[str]]:
    """How a report tells its runs apart: per run (its config and built policy) its departures that not every run
    shares, dotted key -> label, and the labels every run it applies to shares (named once, in a title: the
    questions per context of the long-context runs among lm-eval ones, say). A long-context run
    always counts its questions per context among them, default or not: the protocol is named with every number."""
    found = []
    for config, policy in zip(configs, built, strict=True):
        own = departures(config, policy)
        if (count := questions(config)) is not None:
            own["task.questions"] = count
        found.append({key: label(key, value) for key, value in own.items()})
    keys = dict.fromkeys(key for own in found for key in own)
    shared = {}
    for key in keys:
        texts = {own.get(key) for own, config in zip(found, configs, strict=True) if _applies(key, config)}
        if len(texts) == 1 and None not in texts:
            shared[key] = texts.pop()
    order = sorted(shared, key=lambda key: not key.startswith("policy."))
    return [{key: text for key, text in own.items() if key not in shared} for own in found], [shared[k] for k in order]
