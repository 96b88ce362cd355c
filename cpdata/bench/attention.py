"""Section ``attention``: what a block-sparse kernel pays per CP rank, per layout and tile size.

Each distribution is packed per layout (``bfd``, split) at 8K / 32K / 128K. Per pack and rank: the live tiles
of the document-causal mask (:func:`cpdata.layout.tiles.live_tiles`, flex's ``create_block_mask`` counts) and
the K/V needed from others (:func:`cpdata.layout.tiles.kv_recv_tokens`). Means over packs:
``tiles_max_over_ideal`` (busiest rank over :func:`cpdata.layout.tiles.ideal_tiles`; ``_p95``;
``tiles_integer_bound``: the floor of any layout of whole blocks), ``kv_recv_fraction`` (over an all-gather's
``(cp - 1) / cp * S``), ``solve_us_per_pack`` / ``maps_us_per_pack`` (layout tables, then one row and the
inverse; thread CPU time), ``varlen_max_over_ideal`` / ``varlen_max_over_flex_ideal`` (a varlen kernel's
tiles, :func:`cpdata.layout.tiles.varlen_live_tiles`), ``dense_mask_mib`` / ``flex_mask_mib`` (one
rank's dense ``[L, S]`` mask and ``BlockMask``).
"""

from __future__ import annotations

import time

import numpy as np

from cpdata.bench.distributions import first_packs
from cpdata.layout.maps import layout_runs, layout_spec
from cpdata.layout.tiles import block_tiles, ideal_tiles, kv_recv_tokens, live_tiles, varlen_live_tiles

__all__ = ["COLUMNS", "LAYOUTS", "TABLE", "flex_mask_bytes", "run"]

COLUMNS: tuple[str, ...] = (
    "distribution", "capacity", "cp_size", "layout", "tile", "tiles_max_over_ideal", "kv_recv_fraction",
    "solve_us_per_pack",
)  # fmt: skip
TABLE: tuple[str, ...] = (*COLUMNS, "maps_us_per_pack", "tiles_max_over_ideal_p95", "tiles_integer_bound",
                          "varlen_max_over_ideal", "varlen_max_over_flex_ideal", "dense_mask_mib", "flex_mask_mib", "packs")  # fmt: skip
TITLE = "busiest rank's live kernel tiles over the ideal, K/V it must receive, layout solve time"
LAYOUTS: tuple[str, ...] = ("contiguous", "round_robin", "thd", "balanced", "tiled")
NAMES: tuple[str, ...] = ("alpaca", "sft", "ultrachat", "long_context", "stdlib")
CAPACITIES: tuple[int, ...] = (8192, 32768, 131072)
CP_SIZES: tuple[int, ...] = (2, 4, 8)
TILE_SIZES: tuple[int, ...] = (128, 256)
PACKS, QUICK_PACKS = 10, 3


def flex_mask_bytes(local_len: int, keys: int, tile: int) -> int:
    """Bytes of a flex ``BlockMask`` over ``[local_len, keys]``: int32 block counts ``[nq]`` / ``[nk]`` and
    block indices ``[nq, nk]`` / ``[nk, nq]``, full and partial, forward and transposed."""
    nq, nk = -(-local_len // tile), -(-keys // tile)
    return 4 * (2 * nq + 2 * nk + 4 * nq * nk)


def _solve_us(layout: str, cp: int, packs: list[np.ndarray], capacity: int, repeats: int) -> tuple[float, float]:
    """Median thread CPU times of one pack's layout tables, then of one rank's row and the inverse map."""
    solve, maps = [], []
    for _ in range(repeats):
        for lens in packs:
            t0 = time.thread_time_ns()
            table = layout_runs(layout, cp, lens, capacity, checked=True)
            t1 = time.thread_time_ns()
            table.row(cp - 1)
            table.inverse()
            maps.append(time.thread_time_ns() - t1)
            solve.append(t1 - t0)
    return float(np.median(solve)) / 1e3, float(np.median(maps)) / 1e3


def _cell(name: str, capacity: int, cp: int, layout: str, tiles: tuple[int, ...], n: int, repeats: int
          ) -> list[dict]:  # fmt: skip
    """The rows of one layout at every tile size (one packing and one set of maps for a tile-free layout)."""
    out = []
    specs = [(layout_spec(layout, t), (t,)) for t in tiles] if layout == "tiled" else [(layout, tiles)]
    for spec, for_tiles in specs:
        packs = first_packs(name, capacity, spec, cp, n)
        rows = [layout_runs(spec, cp, lens, capacity).rows() for lens in packs]  # (the tail joins the last slot)
        recv = float(np.mean([kv_recv_tokens(r, lens, capacity).max() for r, lens in zip(rows, packs, strict=True)])
                     / ((cp - 1) / cp * capacity))  # fmt: skip
        solve, maps = _solve_us(spec, cp, packs, capacity, repeats)
        for tile in for_tiles:
            ideal = [ideal_tiles(lens, capacity, tile, cp) for lens in packs]
            over = [float(live_tiles(r, lens, capacity, tile).max() / i)
                    for r, lens, i in zip(rows, packs, ideal, strict=True)]  # fmt: skip
            costs = [block_tiles(lens, capacity, tile) for lens in packs]
            bound = [max(-(-int(c.sum()) // cp), int(c.max())) / i for c, i in zip(costs, ideal, strict=True)]
            whole = [int(varlen_live_tiles(np.arange(capacity)[None], lens, capacity, tile)[0]) for lens in packs]
            busiest = [int(varlen_live_tiles(r, lens, capacity, tile).max()) for r, lens in zip(rows, packs, strict=True)]
            local = capacity // cp
            out.append({
                "distribution": name, "capacity": capacity, "cp_size": cp, "layout": layout, "tile": tile,
                "tiles_max_over_ideal": float(np.mean(over)),
                "tiles_max_over_ideal_p95": float(np.percentile(over, 95)),
                "tiles_integer_bound": float(np.mean(bound)),
                "varlen_max_over_ideal": float(np.mean([b / (w / cp) for b, w in zip(busiest, whole, strict=True)])),
                "varlen_max_over_flex_ideal": float(np.mean([b / i for b, i in zip(busiest, ideal,
                                                                                    strict=True)])),
                "kv_recv_fraction": recv, "solve_us_per_pack": solve, "maps_us_per_pack": maps,
                "dense_mask_mib": local * capacity / 2**20,
                "flex_mask_mib": flex_mask_bytes(local, capacity, tile) / 2**20, "packs": len(packs),
            })  # fmt: skip
    return out


def run(*, quick: bool) -> list[dict]:
    if quick:  # what CI's quick bench can afford: two distributions at 32K, cp 4, tile 128
        grid, tiles, n, repeats = [(name, 32768, 4) for name in ("sft", "long_context")], (128,), QUICK_PACKS, 2
    else:
        grid = [(name, capacity, cp) for name in NAMES for capacity in CAPACITIES for cp in CP_SIZES]
        tiles, n, repeats = TILE_SIZES, PACKS, 5
    rows = []
    for name, capacity, cp in grid:
        cells = [row for layout in LAYOUTS for row in _cell(name, capacity, cp, layout, tiles, n, repeats)]
        rows += sorted(cells, key=lambda r: r["tile"])  # (stable: layouts in order within a tile)
    return rows
