"""What a precomputed plan looks like under every CP layout: the numbers behind ``cpdata inspect``.

Each (sampled) pack is re-laid out under every layout accepting the plan's ``cp_size``
(:func:`~cpdata.offline.metrics.realign`) and measured: work imbalance ``max / mean``, per-document alignment
padding and packs then over capacity, the share of per-rank chunks shorter than :data:`SHORT_CHUNK`, and
the busiest rank's live attention tiles over the ideal (on at most :data:`TILE_SAMPLE` packs). Plans above
``sample`` packs are measured on ``sample`` evenly spaced ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpdata.layout.maps import LAYOUTS, check_layout, layout_tile
from cpdata.layout.tiles import ideal_tiles, live_tiles
from cpdata.offline.metrics import PackGeometry, chunk_lengths, imbalance, pack_geometry, rank_work, realign
from cpdata.offline.store import PackStore
from cpdata.sources.fingerprint import sample_positions

__all__ = ["LayoutSummary", "PlanSummary", "layouts_for", "pack_view", "summarize"]

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
        try:
            check_layout(layout, cp_size)
        except ValueError:
            continue
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
    owned, work = rank_work(layout, cfg["cp_size"], geometry)
    return geometry, owned, work


def summarize(store: PackStore, *, sample: int | None = DEFAULT_SAMPLE) -> PlanSummary:
    """Summarize ``store``; layout figures over at most ``sample`` packs (None: all)."""
    cfg, counts, stats = store.config, store.manifest["counts"], store.manifest["stats"]
    per_pack = np.diff(np.asarray(store.arrays["pack_offsets"]))
    picked = np.asarray(sample_positions(store.n_packs, store.n_packs if sample is None else sample), dtype=np.int64)
    layouts = []
    tiled = set(sample_positions(picked.size, TILE_SAMPLE))
    own = [cfg["layout"]] if cfg["layout"] not in layouts_for(cfg["cp_size"]) else []  # e.g. "tiled:256"
    for layout in [*layouts_for(cfg["cp_size"]), *own]:
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
