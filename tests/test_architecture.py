"""docs/architecture.md's table of what each file may import, checked against the imports of every module of the
package (read from the source, function-level imports included): a module imports only from the rows its row's
"may import" column names, or from its own row."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

import h2o_eval

LAYER_TABLE = "## What each file is and may import"


def table() -> list[tuple[str, list[str], list[str]]]:
    """The rows of the table: (layer, file tokens, may-import items)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    lines = text[text.index(LAYER_TABLE) :].splitlines()[4:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        layer, files, _, may = (cell.strip() for cell in line.strip("|").split("|"))
        rows.append((layer, re.findall(r"`([^`]+)`", files), [item.strip() for item in may.split(",")]))
    return rows


def module_files() -> dict[str, Path]:
    """Every module of the package by name (``kernels/`` is ``h2o_eval.kernels``)."""
    found = {}
    for base, package in ((REPO / "h2o_eval", "h2o_eval"), (REPO / "kernels", "h2o_eval.kernels")):
        for path in base.rglob("*.py"):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports; ``from h2o_eval import X`` resolves X to its module."""
    api = h2o_eval._API  # the names the package's root serves, and their modules
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("h2o_eval"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                root = api.get(alias.name, node.module) if node.module == "h2o_eval" else node.module
                found.add(name if name in modules else root)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("h2o_eval")}
    return {name for name in found if name != "h2o_eval.conf"}  # the config files: data, not code


def row_of(module: str, rows) -> int:
    """The table's row of ``module``: the row naming its file, or its folder."""
    relative = module.removeprefix("h2o_eval.").replace(".", "/")
    for index, (_, files, _) in enumerate(rows):
        for token in files:
            if token.endswith("/") and (relative + "/").startswith(token) or relative + ".py" == token:
                return index
            if token == "__init__.py" and module == "h2o_eval":
                return index
    raise AssertionError(f"docs/architecture.md's table names no row for {module}")


def allowed(index: int, rows) -> set[int]:
    """The rows row ``index`` may import from: its own, those its items name (a file, a layer, a layer "and below",
    or "every layer below")."""
    layers = [layer for layer, _, _ in rows]
    order = list(dict.fromkeys(layers))
    ok = {index}
    for item in rows[index][2]:
        names = re.findall(r"`([^`]+)`", item)
        if item.startswith("nothing of the package"):
            continue
        if names:
            ok |= {i for i, (_, files, _) in enumerate(rows) if set(names) & set(files)}
        elif item == "every layer below":
            ok |= {i for i, layer in enumerate(layers) if order.index(layer) > order.index(layers[index])}
        else:
            layer, below = item.removesuffix(" and below"), item.endswith(" and below")
            assert layer in order, f"docs/architecture.md: {item!r} names no layer"
            ok |= {
                i for i, name in enumerate(layers) if name == layer or below and order.index(name) > order.index(layer)
            }
    return ok


def test_every_module_imports_only_what_the_architecture_table_allows():
    rows, modules = table(), module_files()
    wrong = []
    for module, path in sorted(modules.items()):
        mine = row_of(module, rows)
        ok = allowed(mine, rows)
        for name in sorted(imports(path, modules)):
            if name in modules and row_of(name, rows) not in ok:
                wrong.append(f"{module} ({rows[mine][0]}) imports {name} ({rows[row_of(name, rows)][0]})")
    assert not wrong, "\n".join(wrong)
