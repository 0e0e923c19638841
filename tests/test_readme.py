"""Every Python block of the README runs as written (so it cannot drift from the code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)


def test_the_readme_has_python_blocks():
    assert BLOCKS, "no ```python block in README.md"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_a_readme_python_block_runs_as_written(block, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
