"""Megatron-core's released ``BalancedCPScheduler`` (hybrid / dynamic CP) as the world bench reads it.

The scheduler gets ``max_seq_len_per_rank = per_rank`` and a stand-in group whose ``size()`` is the world (the one
call its constructor makes); each of its groups is one micro-batch, a sub-sample on ``c`` ranks laid out as TE
THD's ``2c`` chunks and counted as TE THD pays (:func:`thd_part`): its tiles, the keys each rank receives from the
others of its sub-sample (``(c - 1) / c`` of it) and those from other nodes. Kept apart from
:mod:`cpdata.bench.world`, which deals cpdata's side, so the peer's reading has one home.
"""

from __future__ import annotations

import functools
import gc
import time
import types

import numpy as np

from cpdata.layout.maps import rank_indices
from cpdata.layout.tiles import live_tiles
from cpdata.layout.world_deal import alone_tiles

__all__ = ["TILE", "Reading", "first_step", "megatron_micro_batches", "megatron_steps", "thd_part"]

TILE = 128
"""The tile both systems are counted in (flash's and flex's block)."""
Reading = tuple[list[tuple[np.ndarray, ...]], list[float], list[int]]
"""Megatron's groups in step order (per group int64 ``[world]`` tiles, received keys, inter-node keys, tokens,
calls), its CPU seconds a step, its groups a step."""


@functools.lru_cache(maxsize=4096)
def thd_part(s: int, c: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
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
                           ) -> tuple[list[tuple[np.ndarray, ...]], float] | str:  # fmt: skip
    """Megatron's schedule of ``lengths``: per group, int64 ``[world]`` tiles, received keys, inter-node keys, the
    tokens each GPU holds (the positions it computes) and its sub-samples (Megatron runs each as its own forward
    and backward), and the CPU seconds of the whole schedule; or why megatron-core cannot be imported."""
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
        tiles, recv, inter, tokens = (np.zeros(world, dtype=np.int64) for _ in range(4))
        calls = np.array([len(sids) for sids in gpu_ids], dtype=np.int64)
        for sid, ranks in members.items():
            part_tiles, part_tokens = thd_part(int(lengths[sid]), len(ranks))
            held = np.asarray(part_tokens, dtype=np.int64)
            at = np.asarray(ranks)
            tiles[at] += part_tiles
            tokens[at] += held
            recv[at] += held.sum() - held
            other = node[at][:, None] != node[at][None, :]
            inter[at] += (other * held[None, :]).sum(axis=1)
        out.append((tiles, recv, inter, tokens, calls))
    return out, seconds


def megatron_steps(steps: list[list[np.ndarray]], world: int, per_rank: int, node_size: int
                   ) -> Reading | str:  # fmt: skip
    """Megatron's scheduler on each step's documents (``steps``: per step, its packs' slot lengths): its groups in
    step order, its CPU seconds a step, the groups a step; or why megatron-core cannot be imported."""
    mbs, seconds, counts = [], [], []
    for packs in steps:
        got = megatron_micro_batches(np.concatenate(packs).tolist(), world, per_rank, node_size)
        if isinstance(got, str):
            return got
        mbs += got[0]
        seconds.append(got[1])
        counts.append(len(got[0]))
    return mbs, seconds, counts


def first_step(theirs: Reading | str) -> Reading | str:
    """The first step of :func:`megatron_steps`'s reading (the step row's documents are the stream's first step's)."""
    if isinstance(theirs, str):
        return theirs
    mbs, seconds, counts = theirs
    return mbs[: counts[0]], seconds[:1], counts[:1]
