"""Document-length distributions the benchmarks pack: seeded, reproducible.

The synthetic ones are :mod:`cpdata.packing.distributions` (``alpaca`` ~90
tokens, ``sft`` ~670, ``ultrachat`` ~1,450, ``web`` ~690, ``long_context``:
median 2,000, sigma 1.5, capped at 128K). ``stdlib`` is one real corpus: every
``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``
excluded), sorted by path, one document per file, length = size in bytes (one
token per byte; ~1,760 files, mean ~17,900 bytes on CPython 3.11). Empty and
unreadable files are skipped; ``n`` and ``seed`` do not apply to it.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from cpdata.packing.distributions import sample_lengths

__all__ = ["NAMES", "sample", "stdlib_paths"]

NAMES: tuple[str, ...] = ("alpaca", "sft", "ultrachat", "web", "long_context", "stdlib")
"""Every distribution the bench packs, in table order."""


def stdlib_paths() -> list[Path]:
    """Sorted ``.py`` files of the running interpreter's standard library (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _stdlib_lengths() -> np.ndarray:
    sizes = []
    for path in stdlib_paths():
        try:
            if not os.access(path, os.R_OK):
                continue
            size = path.stat().st_size
        except OSError:
            continue
        if size > 0:
            sizes.append(size)
    return np.asarray(sizes, dtype=np.int64)


def sample(name: str, n: int, seed: int = 0) -> np.ndarray:
    """int64 document lengths of distribution ``name``: ``[n]`` draws, or every stdlib file."""
    if name == "stdlib":
        return _stdlib_lengths()
    return sample_lengths(name, n, seed)
