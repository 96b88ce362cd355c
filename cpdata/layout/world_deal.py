"""The ``world`` deal: which rank of the whole DP x CP world owns which tokens of one world micro-batch.

Every rank owns exactly ``L = S / W`` positions of the ``S``-token pack (``W`` ranks, ``node_size`` per node).

0. *Plan*: a pack the world packer made is replayed from its slot lengths, nothing cut
   (:func:`~cpdata.layout.world_plan.plan_runs`).

Any other pack is dealt by steps 1-3; the per-document CP degree comes out of the deal:

1. *Spread* (longest first): a document longer than ``L``, or costing more tiles alone than a rank's share
   (the pack's tiles over ``W``), spreads over the fewest ``c >= ceil(s / L)`` ranks whose predicted busiest
   time, ``max(tiles / c, keys over each link)`` (:class:`~cpdata.layout.world_cost.WorldCost`), stays within
   the share (else the ``c`` predicting least): the least loaded ranks of one node when they fit, in TE
   THD's ``2c`` chunks (rank ``i`` takes chunks ``i`` and ``2c - 1 - i``).
2. *Whole* (costliest first): each document to the least loaded rank with room (it receives no keys); one
   that no rank can hold is cut over the least loaded ranks with room, the first piece's node first.
3. *Pad*: the tail fills every rank up to ``L`` (a pad block costs one diagonal tile).

Steps 1-2 run for each of :data:`SPREAD_FRACTIONS` and the deal whose busiest rank is predicted least is
kept. Loads are :func:`grid_tiles`, a stream-grid kernel's expected tiles; ``cpdata bench --sections world``
measures the real ones (:func:`cpdata.layout.tiles.exchange_tiles`) and the cost of the deal.

``W`` is the world (DP folded in); the layout string carries ``node_size`` (``"world:8"``,
:func:`cpdata.layout.maps.layout_spec`), never read from the environment. Dealt on the dataloader worker: no
process group per CP degree, no in-step collective, no host sync; :func:`world_block` builds span tables.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from cpdata.layout.runs import _per_pack
from cpdata.layout.spans import SpanBlock
from cpdata.layout.world_cost import H100_DEFAULTS, WorldCost
from cpdata.layout.world_owners import owned_runs
from cpdata.layout.world_plan import WorldBins, alone_tiles, grid_tiles, plan_runs

__all__ = ["MIN_SPREAD", "SPREAD_FRACTIONS", "alone_tiles", "grid_tiles", "world_block", "world_runs"]

MIN_SPREAD = 0.25
"""Documents shorter than this fraction of a rank's tokens are spread only when they cost more than a share."""

SPREAD_FRACTIONS: tuple[float, ...] = (1.0, 0.5, 0.25)
"""Step 1 is tried spreading the documents that cost more than each of these fractions of a rank's share of
tiles (below 1.0 only those of at least :data:`MIN_SPREAD` of a rank's tokens); docs/benchmarks.md measures
what the three buy over 1.0 alone."""


def _degree(s: int, t: float, local: int, share: float, cost: WorldCost, node_size: int, world: int) -> int:
    """Step 1's ``c`` for a document of ``s`` tokens and ``t`` tiles alone."""
    lo = max(2, -(-s // local))
    budget = share * cost.per_tile_seconds
    best, best_time = lo, math.inf
    for c in range(lo, world + 1):
        # the rank with the first and last chunks receives the other c - 1 ranks' share: from its own node's
        # (up to node_size - 1 of them) over NVLink, the rest over the inter-node link
        near = min(c, node_size) - 1
        link = max(s * near / c / cost.keys_per_tile(inter_node=False),
                   s * (c - 1 - near) / c / cost.keys_per_tile(inter_node=True))  # fmt: skip
        predicted = max(t / c, link) * cost.per_tile_seconds
        if predicted <= budget:
            return c
        if predicted < best_time:
            best, best_time = c, predicted
    return best


def _pick(c: int, piece: int, room: list[int], load: list[float], node_size: int) -> list[int] | None:
    """``c`` ranks with room for ``piece`` tokens: the least loaded of one node when one can host them, else of
    the fewest nodes (nodes with most such ranks first); None when fewer than ``c`` ranks have room."""
    fits = [r for r in range(len(room)) if room[r] >= piece]
    if len(fits) < c:
        return None
    by_node = {node: list(rs) for node, rs in itertools.groupby(fits, key=lambda r: r // node_size)}
    if c <= node_size:
        hosts = [rs for rs in by_node.values() if len(rs) >= c]
        if hosts:
            best = min(hosts, key=lambda rs: sum(sorted(load[r] for r in rs)[:c]))
            return sorted(sorted(best, key=lambda r: load[r])[:c])
    chosen: list[int] = []
    for rs in sorted(by_node.values(), key=len, reverse=True):
        chosen += sorted(rs, key=lambda r: load[r])[: c - len(chosen)]
        if len(chosen) == c:
            return sorted(chosen)
    return None


def _spread(s: int, t: float, fraction: float, share: float, local: int, tile: int) -> bool:
    """Whether a document of ``s`` tokens and ``t`` tiles is spread (step 1) at ``fraction`` of the share: one
    longer than a rank, or costing more than its share; below 1.0, one of at least :data:`MIN_SPREAD` of a
    rank's tokens and 4 tiles costing more than ``fraction`` of the share (shorter ones always stay whole)."""
    if s > local or t > share:
        return True
    return fraction < 1.0 and s >= max(MIN_SPREAD * local, 4 * tile) and t > fraction * share


def _deal(lens: list[int], offsets: list[int], alone: list[float], share: float, spread: tuple[int, ...],
          local: int, world: int, node_size: int, tile: int, cost: WorldCost
          ) -> tuple[list[tuple[int, int, int]], list[float]]:  # fmt: skip
    """Steps 1-2 with the documents ``spread`` spread (the rest whole): ``(runs, loads)``."""
    bins = WorldBins(local, world, node_size, tile)
    runs: list[tuple[int, int, int]] = []  # (global start, length, rank)
    leftover: list[int] = []
    for d in sorted(spread, key=lambda d: -lens[d]):
        s = lens[d]
        c = _degree(s, alone[d], local, share, cost, node_size, world)
        picks = (_pick(k, -(-s // k), bins.room, bins.load, node_size) for k in range(c, world + 1))
        ranks = next((rs for rs in picks if rs is not None), None)  # the fewest ranks with room, from c
        if ranks is None:
            leftover.append(d)  # no c ranks with room for equal pieces: cut by room in step 2
            continue
        runs += [(offsets[d] + o, n, r) for o, n, r in bins.take_thd(s, ranks)]
    chosen = set(spread)
    whole = [d for d, s in enumerate(lens) if s > 0 and d not in chosen]
    whole.sort(key=lambda d: (-alone[d], -lens[d]))
    for d in whole:
        if lens[d] > bins.max_room:
            leftover.append(d)
            continue
        r = bins.least_loaded(lens[d])
        bins.take(r, lens[d], alone[d])
        runs.append((offsets[d], lens[d], r))
    for d in leftover:  # cut over the ranks with most room, one node first
        _cut(offsets[d], lens[d], bins, runs)
    return runs, bins.load


def world_runs(slot_lens: np.ndarray, pack_len: int, world: int, node_size: int, tile: int = 128,
               cost: WorldCost = H100_DEFAULTS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The deal of one pack: ``(starts, lengths, owners)`` int64 ``[R]``, runs of consecutive positions sorted
    by global start, tiling ``[0, pack_len)``; every rank's runs hold ``pack_len / world`` positions.

    ``slot_lens`` int64 ``[D]`` checked lengths summing to at most ``pack_len`` (the rest is the pad tail),
    ``pack_len`` a multiple of ``world``, ``world`` a multiple of ``node_size`` (checked by the caller).
    """
    local = pack_len // world
    planned = plan_runs(slot_lens, pack_len, world, node_size, tile)
    if planned is not None:  # the world packer's plan: nothing cut
        return _with_pad(planned, int(slot_lens.sum()), local, world)
    lens = slot_lens.tolist()
    offsets = list(itertools.accumulate(lens, initial=0))
    real_end = offsets[-1]
    alone = [grid_tiles(s, tile) for s in lens]
    share = (sum(alone) + (pack_len - real_end) // tile) / world
    spreads = dict.fromkeys(tuple(d for d, s in enumerate(lens) if _spread(s, alone[d], f, share, local, tile))
                            for f in SPREAD_FRACTIONS)  # step 1's distinct choices, in order
    deals = [_deal(lens, offsets, alone, share, spread, local, world, node_size, tile, cost)
             for spread in spreads]
    runs = min(deals, key=lambda deal: max(deal[1]))[0]  # the busiest rank predicted least (ties: the first)
    return _with_pad(runs, real_end, local, world)


def world_block(lens: np.ndarray, counts: np.ndarray | None, pack_len: int, cp_size: int, node_size: int,
                tile: int = 128, cost: WorldCost = H100_DEFAULTS, owners: Sequence[np.ndarray | None] | None = None
                ) -> SpanBlock:  # fmt: skip
    """``world`` tables of ``P`` packs (``lens`` int64 ``[N]`` checked slot lengths, ``counts`` int64 ``[P]``
    slots per pack, None: one pack): one :func:`world_runs` per pack, each run a span; a pack whose ``owners``
    (int64 ``[D_p, 2]``, a world step's) are given is laid out from them
    (:func:`~cpdata.layout.world_owners.owned_runs`)."""
    packs = _per_pack(lens, counts)
    owned = [None] * len(packs) if owners is None else list(owners)
    if len(owned) != len(packs):
        raise ValueError(f"owners for {len(owned)} packs, slot lengths for {len(packs)}")
    runs = [world_runs(pack, pack_len, cp_size, node_size, tile, cost) if own is None
            else owned_runs(pack, np.asarray(own, dtype=np.int64).reshape(-1, 2), pack_len, cp_size, node_size)
            for pack, own in zip(packs, owned, strict=True)]  # fmt: skip
    starts, lengths, owners = (np.concatenate(part) for part in zip(*runs, strict=True))
    spans = np.array([r[0].shape[0] for r in runs], dtype=np.int64)
    return SpanBlock(pack_len, cp_size, lens, counts, starts, lengths, owners, spans)


def _with_pad(runs: list[tuple[int, int, int]], real_end: int, local: int, world: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Step 3: the pad tail from ``real_end`` fills every rank up to ``local`` positions, in rank order; the
    runs as int64 ``(starts, lengths, owners)`` sorted by global start."""
    room = [local] * world
    for _, n, r in runs:
        room[r] -= n
    at = real_end
    for r in range(world):
        if room[r]:
            runs.append((at, room[r], r))
            at += room[r]
    out = np.array(sorted(runs), dtype=np.int64).reshape(-1, 3)
    return out[:, 0].copy(), out[:, 1].copy(), out[:, 2].copy()


def _cut(start: int, s: int, bins: WorldBins, runs: list[tuple[int, int, int]]) -> None:
    """Cut ``s`` tokens from ``start`` into pieces over the least loaded ranks with room, the first piece's node
    first, each later piece on a rank that needs the earlier ones' keys."""
    room, load, node_size = bins.room, bins.load, bins.node_size
    open_ranks = [r for r in range(len(room)) if room[r] > 0]
    first = min(open_ranks, key=lambda r: (load[r], -room[r]))
    order = sorted(open_ranks, key=lambda r: (r // node_size != first // node_size, load[r], -room[r]))
    done = 0
    for r in order:
        if done == s:
            break
        take = min(room[r], s - done)
        runs.append((start + done, take, r))
        bins.take(r, take, grid_tiles(done + take, bins.tile) - grid_tiles(done, bins.tile))
        done += take
    assert done == s, "the pack holds more tokens than its ranks"
