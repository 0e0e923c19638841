"""The result store: one JSON record per run, written atomically, named by what determines the result."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from importlib import metadata
from pathlib import Path
from typing import Any

from h2o_eval import data, packs, settings
from h2o_eval.files import atomic_write
from h2o_eval.policies import Policy, configured_interval, configured_policy
from h2o_eval.runners import runner_of

SCHEMA_VERSION = 1
VERSIONED_PACKAGES = ("torch", "transformers", "lm_eval", "datasets", "hydra-core", "h2o_eval")
# Settings that change where a run is written or how it is reported, never its numbers. The data's folder is
# not identity, its content is (``data`` in :func:`identity`).
NOT_IDENTITY = (
    "results_dir",
    "overwrite",
    "on_error",
    "wandb",
    "batch_size",
    "stack_cells",
    "device",
    "data_dir",
    "kernels",
    "graphs",
    "threads",
    "interval",  # identity only under decoding=interval (_identity)
    "turns",  # identity only under protocol=turns (_identity)
)
# What every record holds and the plot reads; a JSON file without these is not a record.
RECORD_KEYS = (
    "model",
    "task",
    "policy",
    "budget",
    "protocol",
    "num_fewshot",
    "limit",
    "metrics",
    "n_samples",
    "created",
)


UNSAFE = re.compile(r"[^A-Za-z0-9._=+,-]")  # characters a record's name replaces with _


class UnreadableRecord(ValueError):
    """A file where a record should be that is not one (truncated, not JSON, or without a record's keys)."""


def identity(config: dict[str, Any], policy: Policy | None = None) -> dict[str, Any]:
    """The part of a resolved config that determines a run's numbers: its settings (those of its runner's family:
    :meth:`~h2o_eval.runners.Runner.identity`), the policy as built (every parameter, a wrapped base's included,
    whatever the config spelled out), and the data it reads: ``hub``, or the hash of the local files' content (see
    :func:`h2o_eval.data.fingerprint`; for ``task=lm_eval`` with ``task.include_path`` also the task's YAMLs, whose
    folder, like ``data_dir``, is not identity). ``policy``: the config's policy, when it is built already."""
    policy = policy or configured_policy(config)
    return _identity(config, policy.describe(), data_fingerprint(config), interval_params(config, policy))


def interval_params(config: dict[str, Any], policy: Policy) -> dict[str, Any] | None:
    """``decoding=interval``'s settings as built: its counts and its decoding policy described as a policy is
    (every parameter, whatever the config spelled out; None: the run's own), so ``interval.policy=knorm`` and
    ``{name: knorm}`` are one setting and a changed default is a new one. None under another decoding."""
    interval = configured_interval(config, policy)
    if interval is None:
        return None
    built = None if interval.policy is None else interval.policy.describe()
    return {
        "compression_interval": interval.compression_interval,
        "target_size": interval.target_size,
        "target_ratio": interval.target_ratio,
        "policy": built,
    }


def record_identity(record: dict[str, Any]) -> dict[str, Any]:
    """:func:`identity` of a stored record, from what it holds (its config, built policy, built interval settings and
    data hash): nothing is rebuilt or read again."""
    return _identity(record["config"], record["policy_params"], record["data"], record.get("interval_params"))


def _identity(
    config: dict[str, Any], built_policy: dict[str, Any], data_hash: str, interval: dict[str, Any] | None
) -> dict[str, Any]:
    ident = {key: value for key, value in config.items() if key not in NOT_IDENTITY and key != "generation"}
    if ident.get("threshold", 0) is None:  # no threshold: the identity of the records made before the setting
        del ident["threshold"]
    ident["task"] = {key: value for key, value in config["task"].items() if key != "include_path"}
    ident |= runner_of(config["task"]).identity(config)
    ident["built_policy"] = built_policy
    if config.get("decoding") == "interval":
        ident["interval"] = interval
    if config.get("protocol") == "turns":
        ident["turns"] = dict(config["turns"])
    ident["data"] = data_hash
    return ident


def digest(ident: dict[str, Any]) -> str:
    """The hash that ends a record's file name (the first 10 hex digits of the identity's SHA-256)."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:10]


def data_fingerprint(config: dict[str, Any]) -> str:
    """The record's ``data``: what its runner reads, hashed (:func:`h2o_eval.data.fingerprint`)."""
    return data.fingerprint(runner_of(config["task"]).data_files(config["task"], config.get("data_dir")))


def record_path(results_dir: str | Path, config: dict[str, Any], ident: dict[str, Any] | None = None) -> Path:
    """``<results_dir>/<model>__<task>[-<length>]__<policy>[+<parameter>=<value>...]__b<budget>__<protocol>
    [-<decoding>]__[<K>q__]<k>shot__<hash>.json``: the prompt length and questions per context of a long-context
    task, the decoding rule after a compression and every policy parameter that departs from the policy's YAML
    (:func:`h2o_eval.settings.policy_departures`) are in the name; every other setting is in the hash of the
    identity (:func:`identity`; ``ident``, when it is computed already)."""
    ident = identity(config) if ident is None else ident
    task, protocol = config["task"], str(config["protocol"])
    params = settings.policy_departures(ident["built_policy"])
    name = "__".join(
        [
            config["model"]["name"],
            task["name"] + (f"-{task['length']}" if task.get("length") is not None else ""),
            "+".join([config["policy"]["name"], *(f"{k.removeprefix('policy.')}={v}" for k, v in params.items())]),
            f"b{config['budget']}",
            protocol
            + (f"-{config['turns']['history']}-{config['turns']['schedule']}" if protocol == "turns" else "")
            + (f"-{config['decoding']}" if protocol != "simulate" else ""),
            *([f"{count}q"] if (count := settings.questions(config)) is not None else []),
            f"{config['num_fewshot']}shot",
            digest(ident),
        ]
    )
    return Path(results_dir) / f"{UNSAFE.sub('_', name)}.json"


def partial_path(paths: list[Path], config: dict[str, Any]) -> Path:
    """Where cells computed together keep their answers so far (:mod:`h2o_eval.generation.partial`):
    ``<results_dir>/partial/<hash>.json``, the hash of their records' names (their identities) and of the settings
    outside the identity that may change an answer's rounding (batches, stacking, kernels, graphs, device, threads,
    ``decoding=interval``'s settings)."""
    outside = ("results_dir", "overwrite", "on_error", "wandb", "data_dir")
    key = {"records": sorted(path.name for path in paths)} | {
        name: config.get(name) for name in NOT_IDENTITY if name not in outside
    }
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(config["results_dir"]) / "partial" / f"{name}.json"


def stored(path: Path) -> Path | None:
    """The record of ``path``'s setting if one is stored: at ``path``, or under another name that ends in the same
    hash (a name that spells out fewer settings), which is still that setting's record: the hash is the identity.
    Loose or packed (:mod:`h2o_eval.packs`): a packed record is named as its file was."""
    if path.exists():
        return path
    digest_part = path.stem.rsplit("__", 1)[-1]
    loose = sorted(path.parent.glob(f"*__{digest_part}.json"))
    packed = sorted(name for name in packs.entries(path.parent) if name.endswith(f"__{digest_part}.json"))
    if path.name in packed:
        return path
    return next(iter(loose), None) or next((path.parent / name for name in packed), None)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as JSON so that readers see either nothing or the whole file (temp file + rename)."""
    atomic_write(path, json.dumps(record, indent=2, sort_keys=True, default=str))


def stored_outputs(path: Path) -> list[dict[str, Any]] | None:
    """The outputs of the record of ``path``'s setting (:func:`stored`), or None without one."""
    record = stored(path)
    return None if record is None else packs.outputs(packs.outputs_path(record))


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as JSON Lines, atomically like :func:`write_record`."""
    atomic_write(path, "".join(json.dumps(row, default=str) + "\n" for row in rows))


@contextmanager
def exclusive(record: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``record``'s setting: one process computes it while the others wait.

    The lock is the operating system's (``flock``) on a file beside the record, so a killed process releases it. A
    process that has to wait says so, and for which record. The holder removes the file when it is done (no lock
    file outlives its run); a process that then gets the lock of a removed file takes the lock anew.
    """
    record.parent.mkdir(parents=True, exist_ok=True)
    path = record.parent / f".{record.stem}.lock"
    while True:
        handle = path.open("w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting: another process is computing {record.name} (it holds {handle.name})", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        with suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        handle.close()  # its holder removed this file: lock the one now there
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def read_record(path: Path) -> dict[str, Any]:
    """The record at ``path``, or packed under its name beside it; :class:`UnreadableRecord`, naming the file, if
    it is not one."""
    if not path.exists() and (entry := packs.entries(path.parent).get(path.name)) is not None:
        return checked(packs.record(entry), f"{path} (in {packs.PACK})")
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UnreadableRecord(f"{path} is not valid JSON ({error})") from None
    return checked(record, str(path))


def checked(record: Any, where: str) -> dict[str, Any]:
    """``record`` if it holds every key of :data:`RECORD_KEYS`; :class:`UnreadableRecord` naming ``where`` if not."""
    missing = [key for key in RECORD_KEYS if key not in record] if isinstance(record, dict) else list(RECORD_KEYS)
    if missing:
        raise UnreadableRecord(f"{where} is not a record (no {', '.join(missing)})")
    return record


def set_aside(path: Path) -> Path:
    """Move an unreadable record to ``<results_dir>/unreadable/`` (kept for a look, out of the results)."""
    target = path.parent / "unreadable" / path.name
    target.parent.mkdir(exist_ok=True)
    os.replace(path, target)
    return target


def read_records(results_dir: str | Path) -> tuple[list[dict[str, Any]], list[UnreadableRecord]]:
    """Every record directly under ``results_dir``, loose or packed (a loose file over a packed one of its name),
    in the order of their names, and why each file there that is not one was skipped (temp files of unfinished
    writes are no records and are ignored)."""
    folder = Path(results_dir)
    records, unreadable = [], []
    for name in record_names(folder):
        try:
            records.append(read_record(folder / name))
        except UnreadableRecord as error:
            unreadable.append(error)
    return records, unreadable


def pack(folder: Path) -> tuple[int, int]:
    """Pack ``folder``'s loose records and their outputs into its :data:`~h2o_eval.packs.PACK`, with those it
    holds already, then remove the loose files: the pack is read back and compared first. Returns the records
    packed and the pack's bytes. Refused (ValueError, naming the fix): a folder without records, a file that is not
    a record, or answers of a unit stopped part way (``partial/``), which a resumed run takes up."""
    if not folder.is_dir():
        raise ValueError(f"no folder {folder}: give a folder of records")
    if (partial := folder / "partial").is_dir() and any(partial.iterdir()):
        raise ValueError(f"{partial} holds the answers of a unit stopped part way: finish the run first")
    loose = sorted(folder.glob("*.json"))
    records = {name: packs.record(entry) for name, entry in packs.entries(folder).items()}
    rows = {name: entry["rows"] for name, entry in packs.entries(folder).items() if "rows" in entry}
    for path in loose:
        try:
            records[path.name] = read_record(path)
        except UnreadableRecord as error:
            raise ValueError(f"{error}: move it away first") from None
        if (found := packs.outputs(packs.outputs_path(path))) is not None:
            rows[path.name] = found
    if not records:
        raise ValueError(f"no records in {folder}: give the folder a run wrote its records to")
    written = packs.write(folder, records, rows)
    back = packs.entries(folder)
    if {name: packs.record(entry) for name, entry in back.items()} != records or {
        name: entry["rows"] for name, entry in back.items() if "rows" in entry
    } != rows:
        raise RuntimeError(f"{written} does not read back as the records packed: the loose files are kept")
    for path in loose:
        packs.outputs_path(path).unlink(missing_ok=True)
        path.unlink()
    return len(records), written.stat().st_size


def load_records(results_dir: str | Path) -> list[dict[str, Any]]:
    """:func:`read_records`' records, each file skipped named in a warning, so one bad file never hides the
    others."""
    records, unreadable = read_records(results_dir)
    for error in unreadable:
        print(f"warning: skipped {error}", file=sys.stderr)
    return records


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def git_commit() -> dict[str, Any]:
    """The commit of the h2o_eval source tree this run used (``None`` outside a git checkout)."""
    source = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=source, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(dirty) if commit else None}


def record_names(folder: Path) -> list[str]:
    """The file names of ``folder``'s records, loose and packed, sorted."""
    return sorted({path.name for path in folder.glob("*.json")} | set(packs.entries(folder)))


def main(argv: list[str] | None = None) -> None:
    """``python -m h2o_eval.results pack DIR [DIR ...]``: each folder's records packed into one file;
    ``python -m h2o_eval.results list DIR``: the names of its records, loose and packed."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m h2o_eval.results", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="pack each folder's records and outputs into its records.jsonl.gz")
    packing.add_argument("folders", nargs="+", type=Path)
    listing = commands.add_parser("list", help="the file names of a folder's records, loose and packed")
    listing.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(record_names(args.folder)))
        return
    for folder in args.folders:
        try:
            count, size = pack(folder)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        print(f"{folder / packs.PACK}: {count} records, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
