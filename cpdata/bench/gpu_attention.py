"""Per-rank attention time on one GPU against the live tiles each kernel pays, and the fitted cost of a tile.

One GPU plays every rank of the first pack of each distribution (32K cp 4, 128K cp 8): its queries over the
keys it holds (all ``S``; with ``tiled``, own + exchanged), bf16, 32 / 8 heads of dim 128, forward + backward,
through compiled ``flex`` (tiles: the ``BlockMask``'s; exchanged keys padded to a power of two) and
``varlen`` (tiles: :func:`cpdata.layout.causal_tiles.segment_tiles`; a plan ``"cpdata"`` would send to the
fallback is not run). Every rank's ``(tiles, seconds)`` feeds one least-squares line per kernel (``fits``); the
flex line's slope, per layer, goes to ``calibration.json`` (:func:`calibration_file`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from cpdata.bench.distributions import first_packs
from cpdata.bench.timing import alternating_medians, bench_device
from cpdata.layout.causal_tiles import segment_tiles
from cpdata.layout.exchange import exchange_plan
from cpdata.layout.maps import layout_runs
from cpdata.layout.tiles import query_runs, segment_starts

__all__ = ["CONFIGS", "DISTRIBUTIONS", "LAYOUTS", "RankCase", "calibration_file", "fit_line", "rank_cases", "run",
           "time_step"]

TILE, HEADS, KV_HEADS, HEAD_DIM = 128, 32, 8, 128
CONFIGS: tuple[tuple[int, int], ...] = ((32768, 4), (131072, 8))
DISTRIBUTIONS: tuple[str, ...] = ("alpaca", "sft", "ultrachat", "long_context")
LAYOUTS: tuple[str, ...] = ("tiled", "balanced", "thd", "round_robin")  # tiled with its exchange plan
REPEATS = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCase:
    """One rank of one pack: its queries and the keys it holds (numpy, host)."""

    capacity: int
    rank: int
    start: np.ndarray
    """int64 ``[L]``: each query's document slot start (the tail padding joins the last slot)."""
    pos: np.ndarray
    """int64 ``[L]``: each query's global position."""
    key_pos: np.ndarray
    """int64 ``[K]``: the global position of each key held (own then received with an exchange; else
    ``arange(S)``)."""
    exchange: bool


def rank_cases(distribution: str, capacity: int, cp: int, layout: str) -> list[RankCase]:
    """Every rank of the distribution's first pack under ``layout`` (``tiled``: with its exchange plan)."""
    lens = first_packs(distribution, capacity, layout, cp, 1)[0]
    rows = layout_runs(layout, cp, lens, capacity).rows()
    slot, starts = segment_starts(lens, capacity)
    doc_start = starts[slot]
    exchange = layout == "tiled"
    plan = exchange_plan(rows, starts) if exchange else None
    out = []
    for rank, row in enumerate(rows):
        keys = np.concatenate([row, plan.rank(rank).recv_positions()]) if plan is not None else np.arange(capacity)
        out.append(RankCase(capacity=capacity, rank=rank, start=doc_start[row], pos=row, key_pos=keys,
                            exchange=exchange))
    return out


def fit_line(x: np.ndarray, seconds: np.ndarray, per: str = "tile") -> dict:
    """Least squares ``seconds = intercept + slope * x``, the slope named for what ``x`` counts
    (``per_<per>_seconds``: ``per_tile_seconds`` of tiles, ``per_position_seconds`` of positions); None figures
    below two distinct counts."""
    key = f"per_{per}_seconds"
    x, y = np.asarray(x, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if x.size < 2 or np.unique(x).size < 2:
        return {key: None, "intercept_seconds": None, "r2": None, "points": int(x.size)}
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (intercept + slope * x)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((residual**2).sum()) / total if total > 0 else 1.0
    return {key: float(slope), "intercept_seconds": float(intercept), "r2": r2, "points": int(x.size)}


def time_step(step, repeats: int) -> float:
    """Median seconds of ``step()`` after one warm-up call (which compiles), the device synchronised around
    each call (:func:`~cpdata.bench.timing.alternating_medians`)."""
    return alternating_medians((step,), repeats=repeats, warmup=1, device=bench_device())[0]


def _timed(q: torch.Tensor, n_keys: int, attend) -> float:
    """:func:`time_step` of ``attend(q, k, v)`` forward + backward, over random ``k`` / ``v`` of ``n_keys``
    keys."""
    k, v = (torch.randn(1, KV_HEADS, n_keys, HEAD_DIM, device=q.device, dtype=q.dtype, requires_grad=True)
            for _ in range(2))  # fmt: skip
    grad = torch.randn_like(q)
    return time_step(lambda: attend(q, k, v).backward(grad), REPEATS)


def _flex(case: RankCase, q: torch.Tensor, device: torch.device) -> tuple[int, float]:
    from cpdata.adapters.attention_kernels import flex_attention_call
    from cpdata.device.attention_masks import block_mask

    lo = torch.as_tensor(case.start, device=device)[None]  # each query's key interval: its slot start ..
    hi = torch.as_tensor(case.pos, device=device)[None]  # .. itself (the one mask of every cpdata attention)
    if case.exchange:  # the keys padded to a power of two (at most the pack): one compiled shape per bucket
        n_keys = min(case.capacity, 1 << max(0, (case.key_pos.size - 1).bit_length()))
        keys = np.full(n_keys, -1, dtype=np.int64)  # -1: never attended
        keys[: case.key_pos.size] = case.key_pos
        mask = block_mask(lo, hi, case.capacity, key_pos=torch.as_tensor(keys, device=device), block_size=TILE)
    else:
        mask = block_mask(lo, hi, case.capacity, block_size=TILE)
        n_keys = case.capacity
    tiles = int((mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()).item())
    return tiles, _timed(q, n_keys, lambda q, k, v: flex_attention_call(q, k, v, mask, scale=HEAD_DIM**-0.5))


def _varlen(case: RankCase, q: torch.Tensor, device: torch.device) -> tuple[int, float | None, str | None]:
    from cpdata.device import varlen

    first, q_len = query_runs(case.pos, case.start)
    k_len = case.pos[first + q_len - 1] - case.start[first] + 1
    tiles = int(segment_tiles(q_len, k_len, TILE).sum())
    try:
        plan = varlen.varlen_plan(torch.as_tensor(case.start), torch.as_tensor(case.pos),
                                  torch.as_tensor(case.key_pos), window=None, device=device)  # fmt: skip
    except varlen.KeyCopiesError as e:
        return tiles, None, f"not run ('cpdata' falls back to flex): {e}"
    attend = functools.partial(varlen.varlen_attention, plan=plan, scale=HEAD_DIM**-0.5)
    return tiles, _timed(q, case.key_pos.size, attend), None


def run(*, deadline: float, configs=CONFIGS, distributions=DISTRIBUTIONS, layouts=LAYOUTS, device: str = "cuda"
        ) -> dict:  # fmt: skip
    """``{"rows", "ranks", "fits", "calibration", "skipped"}`` on CUDA (no CPU varlen kernel nor flex backward); no
    new pack starts after ``deadline`` (``time.monotonic()``), and what it left out is named."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # one per shape
    device = torch.device(device)
    ranks, rows, skipped = [], [], []
    for name in distributions:  # every distribution at both sizes before the next (the budget may cut the tail)
        for capacity, cp in configs:
            for layout in layouts:
                if time.monotonic() > deadline:
                    skipped.append(f"{name} {capacity // 1024}K cp {cp} {layout}: time budget spent")
                    continue
                per_kernel: dict[str, list[tuple[int, float | None, str | None]]] = {"flex": [], "varlen": []}
                for case in rank_cases(name, capacity, cp, layout):
                    q = torch.randn(1, HEADS, case.pos.size, HEAD_DIM, device=device, dtype=torch.bfloat16,
                                    requires_grad=True)  # fmt: skip
                    per_kernel["flex"].append((*_flex(case, q, device), None))
                    per_kernel["varlen"].append(_varlen(case, q, device))
                    for kernel, points in per_kernel.items():
                        tiles, seconds, note = points[-1]
                        ranks.append({"distribution": name, "capacity": capacity, "cp_size": cp, "layout": layout,
                                      "kernel": kernel, "rank": case.rank, "tiles": tiles, "seconds": seconds,
                                      "note": note})  # fmt: skip
                    del q
                for kernel, points in per_kernel.items():
                    tiles = np.array([p[0] for p in points], dtype=np.float64)
                    secs = [p[1] for p in points]
                    ran = all(s is not None for s in secs)
                    rows.append({
                        "distribution": name, "capacity": capacity, "cp_size": cp, "layout": layout, "kernel": kernel,
                        "busiest_ms": 1e3 * max(secs) if ran else None,
                        "time_max_over_mean": max(secs) / float(np.mean(secs)) if ran else None,
                        "tiles_max_over_mean": float(tiles.max() / tiles.mean()),
                        "busiest_tiles": int(tiles.max()),
                        "note": next((p[2] for p in points if p[2]), None),
                    })  # fmt: skip
    fits = {}
    for kernel in ("flex", "varlen"):
        points = [(r["tiles"], r["seconds"]) for r in ranks if r["kernel"] == kernel and r["seconds"] is not None]
        fits[kernel] = fit_line(np.array([p[0] for p in points]), np.array([p[1] for p in points]))
    name = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
    calibration = calibration_file(fits["flex"]["per_tile_seconds"], name)
    return {"rows": rows, "ranks": ranks, "fits": fits, "calibration": calibration, "skipped": skipped}


def calibration_file(per_tile_seconds: float | None, device_name: str) -> dict:
    """``calibration.json``'s object (a :meth:`~cpdata.layout.world_cost.WorldCost.from_json` file): the
    measured ``per_tile_seconds``, this head shape's ``bytes_per_key`` (K and V in bf16, forward, and their
    gradients back), ``tile`` and ``source``; the links keep their published defaults."""
    return {
        "per_tile_seconds": per_tile_seconds, "bytes_per_key": 2.0 * (2 * KV_HEADS * HEAD_DIM * 2), "tile": TILE,
        "source": f"make gpu-check: flex on {device_name}, bf16, {HEADS} / {KV_HEADS} heads of dim {HEAD_DIM}, "
        f"forward + backward, torch {torch.__version__}; links: published defaults",
    }  # fmt: skip
