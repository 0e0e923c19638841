"""Can the Hugging Face hub (or another server a run needs) answer now? Asked before a run, so an offline
machine gets one line naming the fix instead of a minute of retries and a traceback."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from h2o_eval.errors import ConfigError

PROBE_SECONDS = 5.0


def no_connection(url: str) -> str | None:
    """Why the server of ``url`` cannot be connected to within a few seconds, or None if it can (a probe that
    fails at once where a client would retry for a minute)."""
    parsed = urlparse(url)
    try:
        port = parsed.port or (80 if parsed.scheme == "http" else 443)
        socket.create_connection((parsed.hostname, port), timeout=PROBE_SECONDS).close()
    except OSError as error:
        return f"{parsed.hostname} is unreachable: {error}"
    return None


def unreachable() -> str | None:
    """Why the hub cannot be asked (offline mode, or no connection), or None if it can."""
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else no_connection(constants.ENDPOINT)


def check_model(name: str, hf_id: str) -> None:
    """A hub model must be a local folder, in the local cache, or downloadable now."""
    from huggingface_hub import constants, try_to_load_from_cache

    if Path(hf_id).is_dir() or isinstance(try_to_load_from_cache(hf_id, "config.json"), str):
        return
    if reason := unreachable():
        raise ConfigError(
            f"model={name}: {hf_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {reason}: "
            f"download it once online (`hf download {hf_id}`) or pick a model that is here (e.g. smollm2-135m)"
        )


def check_dataset(task: str, path: str, option: str = "data_dir") -> None:
    """Hub data (no ``data_dir``) must be in a local cache (the hub's downloads or ``datasets``' prepared
    copies) or downloadable now; the refusal names the ``option`` that points at local data."""
    import datasets.config
    from huggingface_hub import constants

    cached = (
        Path(constants.HF_HUB_CACHE) / f"datasets--{path.replace('/', '--')}",
        Path(datasets.config.HF_DATASETS_CACHE) / path.replace("/", "___"),
    )
    if any(folder.is_dir() for folder in cached):
        return
    if reason := "HF_DATASETS_OFFLINE=1" if datasets.config.HF_DATASETS_OFFLINE else unreachable():
        raise ConfigError(
            f"task={task} reads {path} from the Hugging Face hub, which is not cached here and {reason}: "
            f"set {option} to a folder holding {task}/<split>.jsonl"
        )
