"""Saving a figure as PNG and PDF, byte for byte the same when its content is: the PDF carries no creation date,
so regenerating a results directory changes only the figures whose content changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save(fig: Any, stem: Path, **kwargs: Any) -> list[Path]:
    """Write ``fig`` (a matplotlib Figure) to ``stem``.png and ``stem``.pdf with ``savefig``'s ``kwargs``, close
    it and return the two paths."""
    import matplotlib.pyplot as plt

    paths = [stem.with_name(f"{stem.name}.{suffix}") for suffix in ("png", "pdf")]
    for path in paths:
        fig.savefig(path, metadata={"CreationDate": None}, **kwargs)
    plt.close(fig)
    return paths
