"""Section ``balance``: causal attention work per CP rank, per layout.

Documents are packed by each layout's default packer at 32K (128K for long_context; overlong documents split).
Per pack, each rank's causal document-masked work is :func:`cpdata.offline.metrics.rank_work`; the imbalance
is max-rank over mean-rank work (``_mean`` / ``_p95`` / ``_max`` over packs). ``doc_pad_pct``: per-document
alignment padding over all pack tokens; ``equal_tokens``: every rank held ``pack_len / cp`` tokens in every
pack.
"""

from __future__ import annotations

import numpy as np

from cpdata.bench.distributions import NAMES, sample
from cpdata.offline.metrics import imbalance, pack_geometry, rank_work
from cpdata.packing import plan_lengths

__all__ = ["COLUMNS", "LAYOUTS", "run"]

COLUMNS: tuple[str, ...] = (
    "distribution", "layout", "cp_size", "imbalance_mean", "imbalance_p95", "doc_pad_pct", "equal_tokens",
)
TABLE: tuple[str, ...] = (*COLUMNS, "imbalance_max", "packs", "capacity")
TITLE = "max / mean causal document-masked work per rank, over packs of the default packer"
LAYOUTS: tuple[str, ...] = ("contiguous", "round_robin", "thd", "balanced")
CP_SIZES: tuple[int, ...] = (2, 4, 8)
CAPACITY, LONG_CAPACITY = 32768, 131072


def _pack_stats(result, capacity: int, layout: str, cp_size: int, max_packs: int) -> dict:
    offsets = np.asarray(result.pack_offsets)
    doc_len, slot_len = np.asarray(result.doc_len), np.asarray(result.slot_len)
    n_packs = min(offsets.size - 1, max_packs)
    works, equal = [], True
    for p in range(n_packs):
        lo, hi = int(offsets[p]), int(offsets[p + 1])
        rows, work = rank_work(layout, cp_size, pack_geometry(doc_len[lo:hi], slot_len[lo:hi], capacity))
        equal &= rows.shape == (cp_size, capacity // cp_size)
        works.append(work)
    doc_pad = int(slot_len[: offsets[n_packs]].sum() - doc_len[: offsets[n_packs]].sum())  # of the packs read
    imb = imbalance(np.stack(works))
    return {
        "imbalance_mean": float(imb.mean()),
        "imbalance_p95": float(np.percentile(imb, 95)),
        "imbalance_max": float(imb.max()),
        "doc_pad_pct": 100.0 * doc_pad / (n_packs * capacity),
        "equal_tokens": bool(equal),
        "packs": n_packs,
    }


def run(*, quick: bool) -> list[dict]:
    max_packs = 12 if quick else 100
    names = ("sft", "long_context", "stdlib") if quick else NAMES
    rows = []
    for name in names:
        capacity = LONG_CAPACITY if name == "long_context" else CAPACITY
        probe = sample(name, 1000, 0)
        n_docs = int(max_packs * capacity / max(probe.mean(), 1) * 1.1) + 16
        lengths = sample(name, n_docs, 1)
        overflow = {"overflow": "split"} if (lengths > capacity).any() else {}
        for cp_size in CP_SIZES:
            for layout in LAYOUTS:
                result = plan_lengths(lengths, capacity=capacity, layout=layout, cp_size=cp_size, **overflow)
                row = {"distribution": name, "layout": layout, "cp_size": cp_size, "capacity": capacity}
                row.update(_pack_stats(result, capacity, layout, cp_size, max_packs))
                rows.append(row)
    return rows
