"""Per-pack geometry and CP cost metrics for any layout, and what a plan looks like under every layout: the
numbers behind ``cpdata inspect``.

:func:`pack_geometry` places every token of a pack from its pieces' real and slot lengths (O(pack_len)); the
layout's ``rank_indices`` says which rank owns it and :func:`cpdata.layout.maps.causal_work` gives each rank's
work (a split piece attends only to itself in this pack). :func:`realign` re-lays the pieces out for another
layout, so :func:`summarize` measures one plan under every layout accepting its ``cp_size``: work imbalance
``max / mean``, per-document alignment padding and packs then over capacity, the share of per-rank chunks
shorter than :data:`SHORT_CHUNK`, and the busiest rank's live attention tiles over the ideal (on at most
:data:`TILE_SAMPLE` packs); plans above ``sample`` packs are measured on ``sample`` evenly spaced ones.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from cpdata.layout.maps import LAYOUTS, alignment, causal_work, check_layout, layout_tile, rank_indices
from cpdata.layout.runs import segments
from cpdata.layout.tiles import ideal_tiles, live_tiles
from cpdata.offline.store import PackStore
from cpdata.sources.fingerprint import sample_positions

__all__ = ["LayoutSummary", "PackGeometry", "PlanSummary", "chunk_lengths", "imbalance", "layouts_for",
           "pack_geometry", "pack_view", "rank_work", "realign", "summarize"]


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
    within = segments(np.zeros_like(doc_len), doc_len)
    where = segments(np.cumsum(slot_len) - slot_len, doc_len)
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
        joins = (np.diff(row) == 1) & (slot[1:] == slot[:-1]) & real[1:] & real[:-1]
        start = real.copy()
        start[1:] &= ~joins
        run = np.cumsum(start) - 1
        out.append(np.bincount(run[real], minlength=int(start.sum())))
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)


SHORT_CHUNK = 128
DEFAULT_SAMPLE = 2000
TILE = 128
TILE_SAMPLE = 200


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutSummary:
    """CP figures of one layout over the measured packs."""

    layout: str
    imbalance_mean: float
    """Mean over packs of ``max / mean`` per-rank causal work (1.0 = perfect)."""
    imbalance_p95: float
    doc_padding_pct: float
    """Per-document alignment padding, percent of real tokens."""
    packs_over_capacity: int
    """Measured packs whose aligned slots no longer fit the capacity."""
    short_chunk_pct: float
    """Percent of per-rank chunks shorter than ``SHORT_CHUNK`` tokens."""
    chunks: int
    tiles_mean: float = 1.0
    """Mean over packs of the busiest rank's live attention tiles over the ideal (1.0 = perfect)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    """The whole plan at a glance."""

    packs: int
    documents: int
    pieces: int
    real_tokens: int
    padding_pct: float
    lower_bound_pct: float
    docs_per_pack_mean: float
    docs_per_pack_max: int
    measured_packs: int
    """Packs the layout figures were measured on (all, or an even sample)."""
    layouts: tuple[LayoutSummary, ...]


def layouts_for(cp_size: int) -> tuple[str, ...]:
    """Every layout that accepts ``cp_size``."""
    out = []
    for layout in LAYOUTS:
        with contextlib.suppress(ValueError):
            check_layout(layout, cp_size)
            out.append(layout)
    return tuple(out)


def pack_view(store: PackStore, k: int, layout: str) -> tuple[PackGeometry, np.ndarray, np.ndarray]:
    """Pack ``k`` under ``layout``: ``(geometry, rows [cp, local], work int64 [cp])``; another layout than the
    plan's re-aligns the pieces."""
    if not 0 <= k < store.n_packs:
        raise ValueError(f"pack {k} does not exist; the plan {store.path} has packs 0..{store.n_packs - 1}")
    cfg = store.config
    rows = store.pack_slice(k)
    doc_len = np.asarray(store.arrays["doc_len"][rows])
    if layout == cfg["layout"]:
        slot_len, pack_len = np.asarray(store.arrays["slot_len"][rows]), int(cfg["capacity"])
    else:
        slot_len, pack_len = realign(doc_len, cfg["capacity"], layout, cfg["cp_size"])
    geometry = pack_geometry(doc_len, slot_len, pack_len)
    return (geometry, *rank_work(layout, cfg["cp_size"], geometry))


def summarize(store: PackStore, *, sample: int | None = DEFAULT_SAMPLE) -> PlanSummary:
    """Summarize ``store``; layout figures over at most ``sample`` packs (None: all)."""
    cfg, counts, stats = store.config, store.manifest["counts"], store.manifest["stats"]
    per_pack = np.diff(np.asarray(store.arrays["pack_offsets"]))
    picked = np.asarray(sample_positions(store.n_packs, store.n_packs if sample is None else sample), dtype=np.int64)
    layouts = []
    tiled = set(sample_positions(picked.size, TILE_SAMPLE))
    for layout in dict.fromkeys([*layouts_for(cfg["cp_size"]), cfg["layout"]]):  # + the plan's: "tiled:256"
        ratios, chunks, tiles = [], [], []
        padding = real = over = 0
        tile = layout_tile(layout) or TILE
        for i, k in enumerate(picked):
            geometry, owned, work = pack_view(store, int(k), layout)
            if i in tiled:
                slots, n = geometry.slot_len, geometry.pack_len
                ideal = ideal_tiles(slots, n, tile, cfg["cp_size"])
                tiles.append(float(live_tiles(owned, slots, n, tile).max() / ideal) if ideal else 1.0)
            ratios.append(float(imbalance(work)))
            chunks.append(chunk_lengths(owned, geometry.slot_of))
            padding += int((geometry.slot_len - geometry.doc_len).sum())
            real += int(geometry.doc_len.sum())
            over += geometry.pack_len > cfg["capacity"]
        sizes = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        layouts.append(
            LayoutSummary(
                layout=layout,
                imbalance_mean=float(np.mean(ratios)) if ratios else 1.0,
                imbalance_p95=float(np.percentile(ratios, 95)) if ratios else 1.0,
                doc_padding_pct=100.0 * padding / real if real else 0.0,
                packs_over_capacity=int(over),
                short_chunk_pct=100.0 * float(np.mean(sizes < SHORT_CHUNK)) if sizes.size else 0.0,
                tiles_mean=float(np.mean(tiles)) if tiles else 1.0,
                chunks=int(sizes.size),
            )
        )
    return PlanSummary(
        packs=store.n_packs,
        documents=int(store.manifest["input"]["documents"]),
        pieces=int(counts["pieces"]),
        real_tokens=int(counts["real_tokens"]),
        padding_pct=float(stats["padding_pct"]),
        lower_bound_pct=float(stats["lower_bound_pct"]),
        docs_per_pack_mean=float(per_pack.mean()) if per_pack.size else 0.0,
        docs_per_pack_max=int(per_pack.max()) if per_pack.size else 0,
        measured_packs=int(picked.size),
        layouts=tuple(layouts),
    )
