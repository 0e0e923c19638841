"""The install contract: every third-party module the package imports is a dependency that pyproject.toml declares,
so a fresh ``pip install`` never depends on what another package happens to pull in."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# The folders that make the installed package (pyproject.toml maps conf and tasks into it; h2o_eval/kernels
# is a link to kernels/).
PACKAGE_FOLDERS = ("h2o_eval", "conf", "tasks", "kernels")
# Modules imported only in a subprocess that runs beside the project in an environment of its own, never installed
# with it: kvpress 0.5.5 pins transformers < 5.3 (benchmarks.kvpress_compare).
BESIDE = ("kvpress",)


def imported_modules() -> dict[str, Path]:
    """Each top-level module imported by an absolute import anywhere in the package, with one file importing it."""
    found: dict[str, Path] = {}
    for folder in PACKAGE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], path.relative_to(REPO))
    return found


def normalized(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[str, set[str]]:
    """The project's own name and every distribution its dependencies and extras name."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(requirement for extra in extras for requirement in extra)]
    return normalized(project["name"]), {normalized(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


def test_every_third_party_module_the_package_imports_is_a_declared_dependency():
    own, names = declared()
    distributions = packages_distributions()
    undeclared = []
    for module, where in imported_modules().items():
        if module in sys.stdlib_module_names or module in BESIDE:
            continue
        found = distributions.get(module)
        assert found, f"{module} (imported by {where}) is not installed here: install '.[dev]' to check it"
        if own not in map(normalized, found) and not names & set(map(normalized, found)):
            undeclared.append(f"{module} (distribution {' or '.join(found)}, imported by {where})")
    assert not undeclared, "imported but not declared in pyproject.toml: " + "; ".join(undeclared)


def test_from_the_repo_root_import_kernels_is_the_hubs_package_and_transformers_imports():
    """README's commands run from the repo root, which Python puts first on its path. transformers (5.25 on) imports
    the Hugging Face hub's ``kernels`` package at start-up; the top-level ``kernels/`` folder holds no
    ``__init__.py`` (the package reaches it as ``h2o_eval.kernels``, a link), so it never shadows the hub's: from
    the root, ``import kernels`` is the installed distribution's (or, without one, no module of this repo's), and
    transformers and the kernels import."""
    probe = "import kernels, transformers, h2o_eval.kernels.reference as r; print(kernels.__file__); print(r.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    hubs, ours = done.stdout.splitlines()
    assert not (REPO / "kernels" / "__init__.py").exists()
    assert ours == str(REPO / "h2o_eval" / "kernels" / "reference.py")
    try:
        version("kernels")
    except PackageNotFoundError:
        assert hubs == "None"  # a namespace portion: no code of this repo runs as ``kernels``
    else:
        assert hubs != "None" and not hubs.startswith(str(REPO / "kernels")), hubs
