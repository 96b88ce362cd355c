"""Section ``world``: the whole world as one CP group, cpdata's ``world`` deal beside Megatron-core's
``BalancedCPScheduler`` (hybrid / dynamic CP), on the same documents.

The first ``PACKS`` world micro-batches the default packer makes of each distribution (``16 x 8K`` and
``32 x 4K``, 8 ranks per node) go to both systems: cpdata deals each pack (``layout_spec("world",
node_size=8)`` and its K/V exchange plan); Megatron's scheduler (``max_seq_len_per_rank = L``, a stand-in
group whose ``size()`` is ``W``, the one call its constructor makes) schedules all of them at once, each group
one micro-batch, a sub-sample on ``c`` ranks laid out as TE THD's ``2c`` chunks. One tile counter, each
system's kernel as it holds its keys (``tile = 128``): a Megatron sub-sample is its own kernel call
(:func:`cpdata.layout.tiles.live_tiles`), a cpdata rank holds its queries against its own keys then the
exchanged ones (:func:`cpdata.layout.tiles.exchange_tiles`). Two readings of "the busiest rank over a
step": ``tiles``, ``recv_keys``, ``inter_keys`` sum each micro-batch's busiest rank (every micro-batch ends with
its slowest rank: a world all-to-all per layer, or parameters gathered per layer); the ``step_`` columns take
the rank whose sum over the micro-batches is largest (ranks wait only for the peers they exchange with, and
all meet once a step). docs/benchmarks.md defines each column. Where megatron-core cannot be imported, the section says why and gives cpdata's rows alone.
"""

from __future__ import annotations

import functools
import gc
import time
import types

import numpy as np

from cpdata.bench.distributions import first_packs
from cpdata.layout.exchange import node_recv, world_exchange
from cpdata.layout.maps import layout_runs, layout_spec, rank_indices
from cpdata.layout.tiles import exchange_tiles, live_tiles
from cpdata.layout.world_deal import H100_DEFAULTS, WorldCost, alone_tiles

__all__ = ["COLUMNS", "OPTIONS", "RATIOS", "TABLE", "megatron_micro_batches", "run"]

COLUMNS: tuple[str, ...] = ("distribution", "world", "system", "micro_batches", "tiles", "over_mean", "recv_keys",
                            "inter_keys", "step_tiles", "step_over_mean", "step_recv_keys", "step_inter_keys",
                            "predicted_ms", "solve_ms")  # fmt: skip
RATIOS: tuple[str, ...] = ("tiles", "recv_keys", "inter_keys", "step_tiles", "step_recv_keys", "step_inter_keys")
"""The columns each cpdata row also gives over Megatron's (``<column>_vs_megatron``)."""
TABLE: tuple[str, ...] = (*COLUMNS, *(f"{c}_vs_megatron" for c in RATIOS))
TITLE = "the world as one CP group: cpdata's world deal beside Megatron-core's BalancedCPScheduler"
NAMES: tuple[str, ...] = ("alpaca", "sft", "ultrachat", "long_context", "stdlib")
WORLDS: tuple[tuple[int, int], ...] = ((16, 8192), (32, 4096))
NODE_SIZE, TILE = 8, 128
PACKS, QUICK_PACKS = 8, 2
OPTIONS: tuple[str, ...] = ("cost",)
"""``cpdata bench --calibration PATH`` passes ``cost`` (:meth:`WorldCost.from_json`) to :func:`run`."""


@functools.lru_cache(maxsize=4096)
def _thd_part(s: int, c: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(tiles, tokens)`` of each of ``c`` ranks holding a sub-sample of ``s`` tokens as TE THD's ``2c`` chunks
    (padded to a multiple of ``2c``; the pad is tail padding)."""
    if c == 1:
        return (alone_tiles(s, TILE),), (s,)
    padded = -(-s // (2 * c)) * 2 * c
    rows = rank_indices("thd", c, [padded], padded)
    tiles = live_tiles(rows, [s], padded, TILE)
    tokens = (rows < s).sum(axis=1)
    return tuple(tiles.tolist()), tuple(tokens.tolist())


def megatron_micro_batches(lengths: list[int], world: int, per_rank: int, node_size: int
                           ) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], float] | str:  # fmt: skip
    """Megatron's schedule of ``lengths``: per group, int64 ``[world]`` tiles, received keys and inter-node keys,
    and the CPU seconds of the whole schedule; or why megatron-core cannot be imported."""
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except Exception as err:  # noqa: BLE001 (any import failure means: skip, and say why)
        return f"{type(err).__name__}: {err}"
    sched = BalancedCPScheduler(per_rank, types.SimpleNamespace(size=lambda: world))  # all its constructor reads
    gc.collect()  # a full collection owed to earlier allocations is not the schedule's
    t0 = time.thread_time()
    groups, ids = sched.get_groups_and_subsamples([(i, int(n)) for i, n in enumerate(lengths)], None)
    seconds = time.thread_time() - t0
    node = np.arange(world) // node_size
    out = []
    for gpu_ids in ids[: len(groups)]:
        members: dict[int, list[int]] = {}
        for r, sids in enumerate(gpu_ids):
            for sid in sids:
                members.setdefault(sid, []).append(r)
        tiles, recv, inter = (np.zeros(world, dtype=np.int64) for _ in range(3))
        for sid, ranks in members.items():
            part_tiles, part_tokens = _thd_part(int(lengths[sid]), len(ranks))
            held = np.asarray(part_tokens, dtype=np.int64)
            at = np.asarray(ranks)
            tiles[at] += part_tiles
            recv[at] += held.sum() - held
            other = node[at][:, None] != node[at][None, :]
            inter[at] += (other * held[None, :]).sum(axis=1)
        out.append((tiles, recv, inter))
    return out, seconds


def _cpdata(packs: list[np.ndarray], world: int, per_rank: int, cost: WorldCost
            ) -> tuple[list[tuple[np.ndarray, ...]], float]:  # fmt: skip
    spec = layout_spec("world", node_size=NODE_SIZE, cost=cost)
    capacity = world * per_rank
    out, seconds = [], 0.0
    gc.collect()  # a full collection owed to earlier allocations (packing, imports) is not the deal's
    for lens in packs:
        t0 = time.thread_time()
        table = layout_runs(spec, world, lens, capacity, checked=True)
        seconds += time.thread_time() - t0
        plan = world_exchange(table)
        tiles = exchange_tiles(table.rows(), lens, capacity, TILE, plan)
        intra, inter = node_recv(plan, NODE_SIZE)
        out.append((tiles, intra + inter, inter))
    return out, seconds


def _row(name: str, world: int, per_rank: int, system: str, cost: WorldCost, mbs: list[tuple[np.ndarray, ...]],
         seconds: float) -> dict:  # fmt: skip
    tiles, recv, inter = (np.stack(column) for column in zip(*mbs, strict=True))  # int64 [micro-batches, world]
    mean = float(tiles.sum()) / world
    busiest, step = tiles.max(axis=1).sum(), tiles.sum(axis=0).max()
    predicted = sum(float(cost.seconds(t, r - i, i).max()) for t, r, i in mbs)
    return {
        "distribution": name, "world": f"{world}x{per_rank // 1024}K", "system": system,
        "micro_batches": len(mbs), "tiles": int(busiest), "over_mean": busiest / mean if mean else 1.0,
        "recv_keys": int(recv.max(axis=1).sum()), "inter_keys": int(inter.max(axis=1).sum()),
        "step_tiles": int(step), "step_over_mean": step / mean if mean else 1.0,
        "step_recv_keys": int(recv.sum(axis=0).max()), "step_inter_keys": int(inter.sum(axis=0).max()),
        "predicted_ms": predicted * 1e3, "solve_ms": seconds * 1e3 / max(len(mbs), 1),
    }  # fmt: skip


def run(*, quick: bool, cost: WorldCost = H100_DEFAULTS) -> list[dict]:
    """The section's rows; ``cost`` weighs the deal and predicts ``predicted_ms`` for both systems."""
    names, n = (("sft", "long_context"), QUICK_PACKS) if quick else (NAMES, PACKS)
    rows, skipped = [], None
    for name in names:
        for world, per_rank in WORLDS:
            packs = first_packs(name, world * per_rank, layout_spec("world", node_size=NODE_SIZE), world, n)
            mine = _row(name, world, per_rank, "cpdata world", cost, *_cpdata(packs, world, per_rank, cost))
            theirs = megatron_micro_batches(np.concatenate(packs).tolist(), world, per_rank, NODE_SIZE)
            if isinstance(theirs, str):
                skipped = theirs
                rows.append(mine)
                continue
            other = _row(name, world, per_rank, "megatron BalancedCPScheduler", cost, *theirs)
            for column in RATIOS:
                mine[f"{column}_vs_megatron"] = mine[column] / other[column] if other[column] else (
                    1.0 if mine[column] == 0 else float(mine[column]))  # fmt: skip
            rows += [other, mine]
    if skipped is not None:
        print(f"world: megatron-core cannot be imported ({skipped}); its rows are skipped "
              "(pip install megatron-core>=0.16.1)")  # fmt: skip
    return rows
