"""Every Python block of README.md and docs/ runs as written, and every settings table names the policies that
exist (so neither can drift from the code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{page.relative_to(REPO)}:block{i}")
    for page in PAGES
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL))
]
POLICY_ROWS = [
    pytest.param(line, id=str(page.relative_to(REPO)))
    for page in PAGES
    for line in page.read_text().splitlines()
    if line.startswith("| `policy` |")
]


def test_the_python_api_page_has_python_blocks():
    assert re.search(r"```python\n", (REPO / "docs" / "python-api.md").read_text()), "no ```python block"


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS)
def test_a_python_block_of_the_docs_runs_as_written(block, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_readme_and_the_settings_page_each_have_a_policy_row():
    pages = {param.id for param in POLICY_ROWS}
    assert {"README.md", "docs/usage.md"} <= pages, pages


@pytest.mark.parametrize("row", POLICY_ROWS)
def test_a_policy_row_names_every_registered_policy(row):
    from h2o_eval.policies import POLICIES

    names = row.split("|")[2].split("(")[0]
    assert set(re.findall(r"`(\w+)`", names)) == set(POLICIES)
