"""Every Python block of the README runs as written, and its settings table names what exists (so neither can
drift from the code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def test_the_readme_has_python_blocks():
    assert BLOCKS, "no ```python block in README.md"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_a_readme_python_block_runs_as_written(block, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_settings_table_names_every_policy():
    from h2o_eval.policies import POLICIES

    row = next(line for line in README.splitlines() if line.startswith("| `policy` |"))
    names = row.split("|")[2].split("(")[0]
    assert set(re.findall(r"`(\w+)`", names)) == set(POLICIES)
