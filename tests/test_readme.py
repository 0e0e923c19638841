"""Every Python block of README.md and docs/ runs as written (so none can drift from the code)."""

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
