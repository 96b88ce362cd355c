"""Section ``packing``: padding and speed of the packers against a lower bound.

Every distribution is packed at 4K, 16K and 128K by the default packer and by ``next_fit``, ``first_fit``
(Grain-style, 8 open bins) and ``ffd``, with ``balanced`` at cp 8 (no per-document padding: plain bin
packing). ``padding_pct``: pad tokens over pack tokens, every pack. ``lower_bound_pct``: the padding of the
Martello-Toth L2 bound on the fewest packs, over the pieces when overlong documents are split
(``split_bound_pct``, extra: ``ceil(total / capacity)``). A capacity most documents exceed is skipped.
``us_per_doc``: median wall time of one ``plan_lengths`` call per document. ``carry`` and ``wait``: the most
pieces held open between windows and the longest a piece waits, in windows
(:func:`cpdata.packing.planner.carry_and_wait`).
"""

from __future__ import annotations

import math

import numpy as np

from cpdata.bench.distributions import NAMES, sample
from cpdata.bench.timing import alternating_medians
from cpdata.packing import DEFAULT_ALGORITHM, plan_lengths
from cpdata.packing.planner import carry_and_wait

__all__ = ["ALGORITHMS", "COLUMNS", "lower_bound_bins", "run", "split_lower_bound_bins"]

COLUMNS: tuple[str, ...] = ("distribution", "capacity", "algorithm", "padding_pct", "lower_bound_pct", "us_per_doc")
ALGORITHMS: tuple[str, ...] = ("next_fit", "first_fit", "ffd")
TABLE: tuple[str, ...] = (*COLUMNS, "gap_pp", "split_bound_pct", "packs", "docs", "overflow", "carry", "wait")
TITLE = "padding and planning time: default packer vs next_fit, first_fit (8 bins), ffd"
CAPACITIES: tuple[int, ...] = (4096, 16384, 131072)
LAYOUT, CP_SIZE = "balanced", 8


def lower_bound_bins(lengths: np.ndarray, capacity: int) -> int:
    """Martello-Toth L2 bound on the bins of ``capacity`` that hold ``lengths`` (each <= capacity),
    vectorised.

    For every ``a`` in ``[0, C/2]``, items above ``C - a`` and above ``C/2`` each need their own bin, and
    items in ``[a, C/2]`` must fill what the latter leave free.
    """
    w = np.sort(np.asarray(lengths, dtype=np.int64))
    if w.size == 0:
        return 0
    assert w[-1] <= capacity, "L2 needs every item to fit"
    prefix = np.concatenate([[0], np.cumsum(w)])
    n, total, half = w.size, int(prefix[-1]), capacity // 2

    def count_sum_gt(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.searchsorted(w, x, side="right")
        return n - i, total - prefix[i]

    alphas = np.unique(np.concatenate([[0], w[w <= half]]))
    n1, s1 = count_sum_gt(capacity - alphas)  # J1: items above C - a
    n_half, s_half = count_sum_gt(np.array([half]))
    n2, s2 = n_half - n1, s_half - s1  # J2: items in (C/2, C - a]
    i_alpha = np.searchsorted(w, alphas, side="left")
    s3 = (total - prefix[i_alpha]) - s_half  # J3: items in [a, C/2]
    free = n2 * capacity - s2
    extra = np.maximum(0, -((free - s3) // capacity))  # ceil((s3 - free) / C)
    l2 = int((n1 + n2 + extra).max())
    return max(l2, math.ceil(total / capacity))


def split_lower_bound_bins(lengths: np.ndarray, capacity: int) -> int:
    """:func:`lower_bound_bins` after ``overflow="split"``: ``n > capacity`` is ``n // capacity`` full packs
    plus a remainder item."""
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > capacity
    full = int((lengths[over] // capacity).sum())
    items = np.where(over, lengths % capacity, lengths)
    return full + lower_bound_bins(items[items > 0], capacity)


def _padding_pct(bins: int, capacity: int, tokens: int) -> float:
    return 100.0 * (bins * capacity - tokens) / (bins * capacity) if bins else 0.0


def _one(lengths: np.ndarray, capacity: int, algorithm: str, overflow: str | None, repeats: int) -> dict:
    kwargs = {"capacity": capacity, "layout": LAYOUT, "cp_size": CP_SIZE, "algorithm": algorithm,
              "overflow": overflow}
    result = plan_lengths(lengths, **kwargs)
    (seconds,) = alternating_medians((lambda: plan_lengths(lengths, **kwargs),), repeats=repeats, warmup=0)
    placed = int(np.asarray(result.doc_len).sum())
    carry, wait = carry_and_wait(lengths, result.config)
    return {"padding_pct": _padding_pct(result.n_packs, capacity, placed), "packs": result.n_packs,
            "us_per_doc": seconds / lengths.size * 1e6, "carry": carry, "wait": wait}


def run(*, quick: bool) -> list[dict]:
    default = DEFAULT_ALGORITHM
    n_docs, repeats = (20_000, 1) if quick else (100_000, 3)
    capacities = (4096, 131072) if quick else CAPACITIES
    rows = []
    for name in NAMES:
        lengths = sample(name, n_docs, 0)
        for capacity in capacities:
            too_long = int((lengths > capacity).sum())
            if too_long * 2 > lengths.size:
                continue
            overflow = "split" if too_long else None
            total = int(lengths.sum())
            bound = split_lower_bound_bins(lengths, capacity)
            for algorithm in (default, *[a for a in ALGORITHMS if a != default]):
                row = {"distribution": name, "capacity": capacity, "algorithm": algorithm}
                row.update(_one(lengths, capacity, algorithm, overflow, repeats))
                row["lower_bound_pct"] = _padding_pct(bound, capacity, total)
                row["split_bound_pct"] = _padding_pct(math.ceil(total / capacity), capacity, total)
                row.update(docs=int(lengths.size), overflow=overflow or "none",
                           gap_pp=row["padding_pct"] - row["lower_bound_pct"], default=algorithm == default)
                rows.append(row)
    return rows
