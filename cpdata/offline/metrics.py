"""Per-pack geometry and CP cost metrics, for any layout (O(pack_len) per pack and layout).

:func:`pack_geometry` places every token of a pack from its pieces' real and slot lengths; the layout's
``rank_indices`` then says which rank owns it and :func:`cpdata.layout.maps.causal_work` gives each rank's
work (a split piece attends only to itself in this pack). :func:`realign` re-lays the pieces out for another
layout, so one plan can be compared across layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpdata.layout.maps import alignment, causal_work, rank_indices

__all__ = ["PackGeometry", "chunk_lengths", "imbalance", "pack_geometry", "rank_work", "realign"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PackGeometry:
    """Where each token of one pack sits."""

    doc_len: np.ndarray
    """int64 ``[n_slots]``: real tokens per slot."""
    slot_len: np.ndarray
    """int64 ``[n_slots]``: slot lengths (real + per-document padding)."""
    pack_len: int
    """Tokens in the pack; ``pack_len - slot_len.sum()`` is tail padding."""
    positions: np.ndarray
    """int64 ``[pack_len]``: position of each token inside its piece, -1 for padding."""
    slot_of: np.ndarray
    """int64 ``[pack_len]``: slot of each real token, -1 for padding."""


def pack_geometry(doc_len: np.ndarray, slot_len: np.ndarray, pack_len: int) -> PackGeometry:
    """Place the real tokens of each slot at the slot's start; the rest is padding."""
    doc_len = np.asarray(doc_len, dtype=np.int64)
    slot_len = np.asarray(slot_len, dtype=np.int64)
    assert doc_len.shape == slot_len.shape and bool(np.all(doc_len <= slot_len)), (doc_len, slot_len)
    assert int(slot_len.sum()) <= pack_len, (int(slot_len.sum()), pack_len)
    total = int(doc_len.sum())
    real_before = np.cumsum(doc_len) - doc_len
    slot_start = np.cumsum(slot_len) - slot_len
    within = np.arange(total, dtype=np.int64) - np.repeat(real_before, doc_len)
    where = np.repeat(slot_start, doc_len) + within
    positions = np.full(pack_len, -1, dtype=np.int64)
    slot_of = np.full(pack_len, -1, dtype=np.int64)
    positions[where] = within
    slot_of[where] = np.repeat(np.arange(doc_len.shape[0], dtype=np.int64), doc_len)
    return PackGeometry(doc_len=doc_len, slot_len=slot_len, pack_len=pack_len, positions=positions, slot_of=slot_of)


def realign(doc_len: np.ndarray, capacity: int, layout: str, cp_size: int) -> tuple[np.ndarray, int]:
    """``(slot_len int64 [n_slots], pack_len)`` the same pieces need under ``layout``: each padded to the
    layout's document multiple, the pack ``capacity`` unless the slots outgrow it (then the next pack multiple)."""
    doc_multiple, pack_multiple = alignment(layout, cp_size)
    doc_len = np.asarray(doc_len, dtype=np.int64)
    slot_len = -(-doc_len // doc_multiple) * doc_multiple
    need = max(int(capacity), int(slot_len.sum()))
    return slot_len, -(-need // pack_multiple) * pack_multiple


def rank_work(layout: str, cp_size: int, geometry: PackGeometry) -> tuple[np.ndarray, np.ndarray]:
    """``(rows int64 [cp, pack_len // cp], work int64 [cp])``: ``layout``'s rows for the pack and causal work per rank."""
    rows = rank_indices(layout, cp_size, geometry.slot_len, geometry.pack_len)
    return rows, causal_work(rows, geometry.positions).astype(np.int64)


def imbalance(work: np.ndarray) -> np.ndarray:
    """``max / mean`` of per-rank work along the last axis; 1.0 is perfect, and for empty packs."""
    work = np.asarray(work, dtype=np.float64)
    mean = work.mean(axis=-1)
    return np.where(mean > 0, work.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)


def chunk_lengths(rows: np.ndarray, slot_of: np.ndarray) -> np.ndarray:
    """int64 ``[n_chunks]`` over all ranks: lengths of every rank's maximal runs of consecutive global positions of
    one piece's real tokens (short chunks make attention kernels inefficient)."""
    out = []
    for row in np.asarray(rows):
        slot = slot_of[row]
        real = slot >= 0
        if not real.any():
            continue
        joins = (np.diff(row) == 1) & (slot[1:] == slot[:-1]) & real[1:] & real[:-1]
        start = real.copy()
        start[1:] &= ~joins
        run = np.cumsum(start) - 1
        out.append(np.bincount(run[real], minlength=int(start.sum())))
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)
