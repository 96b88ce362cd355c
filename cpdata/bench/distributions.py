"""Seeded inputs of the benchmarks: document-length distributions, token documents, the worker graph.

The synthetic distributions are :mod:`cpdata.packing.distributions`. ``stdlib`` is one real corpus: every
``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (site-packages excluded), sorted by path, one document per
file, length = size in bytes (~1,760 files, mean ~17,900 bytes on CPython 3.11); ``n`` and ``seed`` do not
apply to it.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.bench.corpus import Corpus
from cpdata.packing import plan_lengths
from cpdata.packing.distributions import sample_lengths

__all__ = ["NAMES", "first_packs", "sample", "split_graph", "token_documents"]

NAMES: tuple[str, ...] = ("alpaca", "sft", "ultrachat", "web", "long_context", "stdlib")
"""Every distribution the bench packs, in table order."""


def _stdlib_lengths() -> np.ndarray:
    """Sizes of the running interpreter's readable, non-empty standard library ``.py`` files (no site-packages),
    sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    sizes = []
    for path in sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)):
        try:
            size = path.stat().st_size if os.access(path, os.R_OK) else 0
        except OSError:
            continue
        if size > 0:
            sizes.append(size)
    return np.asarray(sizes, dtype=np.int64)


def sample(name: str | Corpus, n: int, seed: int = 0) -> np.ndarray:
    """int64 document lengths of distribution ``name``: ``[n]`` draws, or every stdlib file; of a user's
    corpus, ``[n]`` of its documents (:meth:`Corpus.draw`)."""
    if isinstance(name, Corpus):
        return name.draw(n, seed)
    if name == "stdlib":
        return _stdlib_lengths()
    return sample_lengths(name, n, seed)


def first_packs(name: str | Corpus, capacity: int, layout: str, cp_size: int, n: int, seed: int = 1
                ) -> list[np.ndarray]:  # fmt: skip
    """Slot lengths (int64 ``[slots]`` each) of the first ``n`` packs ``plan_lengths`` makes of ``name``
    (overlong documents split), from about 1.2 packs' worth of documents per pack."""
    probe = sample(name, 1000, 0)
    lengths = sample(name, int(n * capacity / max(probe.mean(), 1) * 1.2) + 16, seed)
    result = plan_lengths(lengths, capacity=capacity, layout=layout, cp_size=cp_size, overflow="split")
    off, slot = np.asarray(result.pack_offsets), np.asarray(result.slot_len)
    return [slot[off[p] : off[p + 1]] for p in range(min(n, off.size - 1))]


def token_documents(lengths: Iterable[int], seed: int = 0, *, low: int = 0, high: int = 32000) -> list[dict]:
    """One ``{"input_ids": int64 [n]}`` document per length, token ids uniform in ``[low, high)``."""
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(low, high, size=int(n), dtype=np.int64)} for n in lengths]


def split_graph(docs: Any, capacity: int, cp_size: int, layout: str) -> Any:
    """The worker graph up to ``Collate`` (:func:`cpdata.nodes.loader.shard_graph`), overlong documents split.
    """
    from cpdata.nodes.loader import GraphOptions, shard_graph
    from cpdata.nodes.options import StreamPlan

    plan = StreamPlan(overflow="split")
    return shard_graph(docs, GraphOptions(capacity=capacity, cp_size=cp_size, layout=layout, plan=plan))
