"""Keys that cross nodes in a world step, and the close's two moves of spread pieces that look at keys.

A spread piece's role ``j`` receives every chunk before its later one from the other roles
(:func:`~cpdata.layout.spread.chunk_recv`); those held on another node cross the slower link
(:class:`InterNodeKeys` counts them per rank). Closing (:mod:`cpdata.packing.world_steps`, phases 8 and 9), a piece
of the busiest rank beside ranks left empty may spread over them (:func:`spread_out_choice`, as Megatron's scheduler
widens a sample into the GPUs it left empty), and spread pieces may be mirrored where that lowers the busiest
receiver of keys (:func:`mirror_choice`). Both only choose: the packer moves the piece and keeps the step where it
ends less over its mean.
"""

from __future__ import annotations

import functools

from cpdata.layout.spread import spread_chunks
from cpdata.layout.step_loads import StepLoads
from cpdata.layout.world_owners import Placement, owner_ranks
from cpdata.packing.world_fill import FILL_RECEIVE_CAP

__all__ = ["InterNodeKeys", "inter_node_keys", "mirror_choice", "spread_out_choice"]

Step = list[tuple[int, int, Placement]]
"""A step's pieces: ``(key, tokens, placement)``, in placement order."""


@functools.lru_cache(maxsize=4096)
def inter_node_keys(s: int, first: int, c: int, local: int, node_size: int) -> tuple[tuple[int, int], ...]:
    """``(rank, keys)`` of a piece of ``s`` tokens spread at ``(first, c)`` (:func:`owner_ranks`' sign) over ranks
    of ``local`` tokens, ``node_size`` a node: the keys each receives from ranks of other nodes. Role ``j`` needs
    every chunk up to its later one, ``2c - 1 - j`` (:func:`~cpdata.layout.spread.chunk_recv`), so of role ``q``
    its chunk ``q``, and its chunk ``2c - 1 - q`` where ``q > j``."""
    ranks = list(owner_ranks(first, c))
    chunk = spread_chunks(s, abs(c), local, node_size)
    last = 2 * abs(c) - 1
    return tuple((r, sum(chunk[q] + (chunk[last - q] if q > j else 0)
                         for q, rq in enumerate(ranks) if rq // node_size != r // node_size))
                 for j, r in enumerate(ranks))  # fmt: skip


class InterNodeKeys:
    """Per rank, the keys spread pieces bring it from ranks of other nodes: ``world`` ranks of ``local`` tokens,
    ``node_size`` a node."""

    __slots__ = ("local", "node_size", "world")

    def __init__(self, world: int, local: int, node_size: int) -> None:
        self.world, self.local, self.node_size = world, local, node_size

    def per_rank(self, step: Step) -> list[int]:
        """Per rank, the keys it receives from other nodes over ``step``."""
        inter = [0] * self.world
        for _, s, where in step:
            if abs(where[2]) < 2:  # (a whole piece receives nothing)
                continue
            for r, keys in self.of(s, where).items():
                inter[r] += keys
        return inter

    def moved(self, inter: list[int], s: int, old: Placement, new: Placement) -> list[int]:
        """A copy of ``inter`` (each rank's keys from other nodes) with a piece of ``s`` tokens moved from ``old``
        to ``new`` (:meth:`of`)."""
        after = list(inter)
        for sign, where in ((-1, old), (1, new)):
            for r, n in self.of(s, where).items():
                after[r] += sign * n
        return after

    def of(self, s: int, where: Placement) -> dict[int, int]:
        """Keys each rank of a piece of ``s`` tokens at ``where`` receives from ranks of other nodes
        (:func:`inter_node_keys`); empty where its window stays inside a node."""
        _, first, c = where
        lo, hi = (first, first + c - 1) if c > 0 else (first + c + 1, first)
        if lo // self.node_size == hi // self.node_size:
            return {}
        return dict(inter_node_keys(s, first, c, self.local, self.node_size))


def spread_out_choice(bins: StepLoads, step: Step, crossing: InterNodeKeys, h: int) -> tuple[int, Placement] | None:
    """``(index in step, placement)``: a piece busiest rank ``h`` holds part of, in a micro-batch where a rank holds
    nothing, placed again over more ranks than a node (whole nodes, up to the world) in THD's chunks
    (:func:`~cpdata.layout.spread.spread_chunks`), where its busiest rank ends under ``h``'s load and no rank's
    received keys, nor its keys from other nodes, pass the step's busiest receiver or
    :data:`~cpdata.packing.world_fill.FILL_RECEIVE_CAP` times the mean rank's; of those, the least busiest load
    (ties: the first piece, the fewest ranks). None where none. ``bins`` is left as it was
    (:meth:`~cpdata.packing.world_close.StepClose._spread_out` moves the piece)."""
    emptied = {k for k in range(bins.packs) if any(room[k] == bins.local for room in bins.room)}
    if not emptied:  # (most steps: nothing to look at)
        return None
    top, inter = bins.load[h], crossing.per_rank(step)
    top_recv = max(max(bins.recv), FILL_RECEIVE_CAP * sum(bins.recv) / bins.world)
    top_inter = max(max(inter), FILL_RECEIVE_CAP * sum(inter) / bins.world)
    best: tuple[float, int, Placement] | None = None
    for i, (_, s, (k, first, c)) in enumerate(step):
        if k not in emptied or h not in owner_ranks(first, c):
            continue
        widths = [w for w in range(2 * bins.node_size, bins.world + 1, bins.node_size) if w > abs(c)]
        if not widths:
            continue
        bins.remove(s, (k, first, c))
        for choice in bins.choose_widths(s, widths, top_recv):
            if choice is None or choice[0] >= top or (best is not None and choice[0] >= best[0]):
                continue
            where = choice[1:]
            if max(crossing.moved(inter, s, (k, first, c), where)) <= top_inter:
                best = (choice[0], i, where)
        bins.restore(s, (k, first, c))
    return None if best is None else (best[1], best[2])


def mirror_choice(bins: StepLoads, step: Step, crossing: InterNodeKeys, inter_first: bool, inter: list[int],
                  spread: list[int]) -> tuple[int, Placement] | None:
    """``(index in step, mirrored placement)``: of the spread pieces ``spread`` (indices in ``step``) the busiest
    receiver holds part of (``inter_first``: of keys from other nodes; ``inter``: each rank's now), the one whose
    mirror (:func:`~cpdata.layout.world_owners.owner_ranks`) lowers it most, where the mirror fits the ranks' room
    and lifts no rank past the busiest load, the busiest receiver or the busiest inter-node receiver; None where
    none (:meth:`~cpdata.packing.world_close.StepClose._flip` moves the piece)."""
    recv, load = bins.recv, bins.load
    most, top, most_inter = max(recv), max(load), max(inter)
    aim = inter if inter_first else recv
    q = aim.index(max(aim))
    best: tuple[tuple[int, int], int, Placement] | None = None
    for i in spread:
        _, s, (k, first, c) = step[i]
        if q not in owner_ranks(first, c):  # (a range: no pass over it)
            continue
        ranks = list(owner_ranks(first, c))
        need, tiles, keys = (role.tolist() for role in bins.roles(s, abs(c)))
        if any(bins.room[r][k] + n < m for r, n, m in zip(ranks, need, need[::-1], strict=True)):
            continue  # (mirrored, a role of an uneven cut would not fit its rank's room)
        mirrored = (k, ranks[-1], -c)
        after_recv, after_load = list(recv), list(load)
        for r, t, key, t2, key2 in zip(ranks, tiles, keys, tiles[::-1], keys[::-1], strict=True):
            after_recv[r] += key2 - key
            after_load[r] += t2 - t
        after_inter = crossing.moved(inter, s, (k, first, c), mirrored)
        if max(after_load) > top or max(after_recv) > most or max(after_inter) > most_inter:
            continue
        score = (max(after_inter), max(after_recv)) if inter_first else (max(after_recv), max(after_inter))
        if score >= ((most_inter, most) if inter_first else (most, most_inter)):
            continue
        if best is None or score < best[0]:
            best = (score, i, mirrored)
    return None if best is None else (best[1], best[2])
