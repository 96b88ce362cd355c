"""Section ``balance``: causal attention work per CP rank, per layout.

Documents are packed by each layout's default packer at 32K (128K for long_context; overlong documents split).
Per pack, each rank's causal document-masked work is :func:`cpdata.layout.maps.causal_work`; the imbalance is
max-rank over mean-rank work (``_mean`` / ``_p95`` / ``_max`` over packs). ``doc_pad_pct``: per-document
alignment padding over all pack tokens; ``equal_tokens``: every rank held ``pack_len / cp`` tokens in every
pack.
"""

from __future__ import annotations

import numpy as np

from cpdata.bench.distributions import NAMES, sample
from cpdata.layout.maps import causal_work, rank_indices

__all__ = ["COLUMNS", "LAYOUTS", "doc_positions", "run"]

COLUMNS: tuple[str, ...] = (
    "distribution", "layout", "cp_size", "imbalance_mean", "imbalance_p95", "doc_pad_pct", "equal_tokens",
)
TABLE: tuple[str, ...] = (*COLUMNS, "imbalance_max", "packs", "capacity")
TITLE = "max / mean causal document-masked work per rank, over packs of the default packer"
LAYOUTS: tuple[str, ...] = ("contiguous", "round_robin", "thd", "balanced")
CP_SIZES: tuple[int, ...] = (2, 4, 8)
CAPACITY, LONG_CAPACITY = 32768, 131072


def doc_positions(doc_len: np.ndarray, slot_len: np.ndarray, pack_len: int) -> np.ndarray:
    """int64 ``[pack_len]``: each token's position in its document, -1 on slot and tail padding."""
    doc_len = np.asarray(doc_len, dtype=np.int64)
    slot_len = np.asarray(slot_len, dtype=np.int64)
    pos = np.full(pack_len, -1, dtype=np.int64)
    total = int(doc_len.sum())
    if total:
        slot_start = np.cumsum(slot_len) - slot_len
        doc_start = np.cumsum(doc_len) - doc_len
        within = np.arange(total, dtype=np.int64) - np.repeat(doc_start, doc_len)
        pos[np.repeat(slot_start, doc_len) + within] = within
    return pos


def _pack_stats(result, capacity: int, layout: str, cp_size: int, max_packs: int) -> dict:
    offsets = np.asarray(result.pack_offsets)
    doc_len, slot_len = np.asarray(result.doc_len), np.asarray(result.slot_len)
    n_packs = min(offsets.size - 1, max_packs)
    imbalance, equal = [], True
    doc_pad = 0
    for p in range(n_packs):
        lo, hi = int(offsets[p]), int(offsets[p + 1])
        rows = rank_indices(layout, cp_size, slot_len[lo:hi], capacity)
        equal &= rows.shape == (cp_size, capacity // cp_size)
        work = causal_work(rows, doc_positions(doc_len[lo:hi], slot_len[lo:hi], capacity))
        if work.mean() > 0:
            imbalance.append(float(work.max() / work.mean()))
        doc_pad += int(slot_len[lo:hi].sum() - doc_len[lo:hi].sum())
    imb = np.asarray(imbalance)
    return {
        "imbalance_mean": float(imb.mean()),
        "imbalance_p95": float(np.percentile(imb, 95)),
        "imbalance_max": float(imb.max()),
        "doc_pad_pct": 100.0 * doc_pad / (n_packs * capacity),
        "equal_tokens": bool(equal),
        "packs": n_packs,
    }


def run(*, quick: bool) -> list[dict]:
    from cpdata.packing import plan_lengths

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
