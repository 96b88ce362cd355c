"""Where a spread piece goes to fill a closing world step: past the level, in room whole pieces may be cleared
from, where it leaves the busiest rank less over the mean.

The deal (:class:`~cpdata.layout.world_step.StepBins`) holds a spread piece to the level and its receive cap as
pieces come; closing, the loads are exact and the close (:mod:`cpdata.packing.world_steps`, phase 7 and the
refill of phase 8) asks :func:`fill_place` where a waiting or taken-back spread piece would do best, clearing whole
pieces from the slots it needs (they are dealt again or wait). It only chooses: the caller changes the step.
"""

from __future__ import annotations

import numpy as np

from cpdata.layout.spread import megatron_width
from cpdata.layout.step_loads import StepLoads
from cpdata.layout.world_owners import Placement, window_index, window_owners

__all__ = ["FILL_RECEIVE_CAP", "fill_place"]


FILL_RECEIVE_CAP = 1.25
"""Closing, a waiting spread piece filling the step (:func:`fill_place`) lifts no rank's received keys past the most
of: the step's busiest receiver, its own busiest role's keys, and this many times the mean rank's keys after it. At
the deal's :data:`~cpdata.layout.step_loads.RECEIVE_CAP` (1.6), a step of two 24,000-token documents among 512-token
chats at 16 x 8K stacked the second on the first's ranks: twice Megatron's busiest receiver. Held to the first two
alone, a mix of chats and ~30K-token documents at 32 x 4K left its steps as they were (1.037 x the mean rank at seed
4; filled under this cap, 1.010 x)."""


def fill_place(bins: StepLoads, s: int, whole: tuple[np.ndarray, np.ndarray] | None = None,
               below: float | None = None) -> tuple[Placement, list[tuple[int, int]]] | None:  # fmt: skip
    """Where a spread piece of ``s`` tokens goes, past the level, to fill the step: ``(placement, cleared)``,
    ``cleared`` the ``(rank, micro-batch)`` slots whose whole pieces must leave first to make its room; None where no
    place leaves the step's busiest rank less over the mean rank than it stands now (or, where ``below`` is given, no
    place inside one node keeps its busiest load under ``below``: a piece taken back to be placed again, whose keys
    must not cross nodes where they did not). The step is not changed: the caller clears those slots, places the piece
    (:meth:`~cpdata.layout.step_loads.StepLoads.restore`) and deals the pieces it cleared again
    (:mod:`cpdata.packing.world_steps`, which keeps the result only where the step ends less over the mean holding no
    fewer tokens).

    The places: its widths from its fewest ranks up to Megatron's power of two, past it inside a node as an opening
    piece may go (:meth:`~cpdata.layout.world_step.StepBins._spread`); each window, micro-batch and orientation within
    :data:`FILL_RECEIVE_CAP`, each role taking the room it has or, where that is short, the room of its slot cleared
    of its whole pieces (``whole``: float64 ``[world, packs]``, their tokens and tiles; None: no slot is cleared),
    that leave the busiest rank less over the mean (its busiest load or the step's, whichever is more, over the mean
    with its tiles in and the cleared ones out). Of those, the least busiest load, then the fewest tiles added (its
    own less the cleared ones); ties as :func:`~cpdata.layout.world_owners.best_window`'s (the first width,
    micro-batch, rank, the orientation of least busiest receiver, THD's). Least over the mean instead, a wider cut's
    dearer tiles would win where the busiest load is the same: the rows met and the ratios were the same over 400 step
    rows, the work more (docs/benchmarks.md)."""
    top, total = bins.busiest_load, bins.total_load
    room, load, recv = bins.snapshot()
    tokens, tiles = whole if whole is not None else (np.zeros(room.shape), np.zeros(room.shape))
    fewest = -(-s // bins.local)
    if total <= 0 or fewest > bins.world or s > bins.free_tokens + tokens.sum():
        return None
    most = min(bins.world, megatron_width(s, bins.local))
    widest = most if most >= bins.node_size else min(bins.node_size, bins.world, 2 * most)
    widest = widest if below is None else min(widest, bins.node_size)  # (placed again: inside a node)
    best: tuple[tuple[float, float], Placement, list[tuple[int, int]]] | None = None
    for c in range(fewest, widest + 1):
        cut = bins.cut(s, c)
        if cut is None:
            continue
        need, added, keys = cut
        mean = (int(recv.sum()) + int(keys.sum())) / bins.world
        cap = max(int(recv.max()), int(keys.max()), FILL_RECEIVE_CAP * mean)
        starts, at, roles = window_index(bins.world, bins.node_size, c)
        held = room[at][None]  # [1, windows, c, packs]
        wants = need[roles][:, None, :, None]  # [2, 1, c, 1]
        clear = (held < wants) & (held + tokens[at][None] >= wants)  # [2, windows, c, packs]
        receiver = (recv[at][None] + keys[roles][:, None]).max(2)  # [2, windows]
        fits = ((held >= wants) | clear).all(2) & (receiver <= cap)[..., None]
        after = load[at][None, :, :, None] + added[roles][:, None, :, None] - np.where(clear, tiles[at][None], 0)
        score = np.maximum(after.max(2), top)  # [2, windows, packs]
        net = int(added.sum()) - np.where(clear, tiles[at][None], 0).sum(2)
        over = score / np.maximum(total + net, 1e-9)  # (cleared tiles past the rest: no division by zero)
        o, a, k = np.nonzero(fits & (over * total < top if below is None else score < below))
        if not o.size:
            continue
        i = int(np.lexsort((o, receiver[o, a], a, k, net[o, a, k], score[o, a, k]))[0])
        o, a, k = int(o[i]), int(a[i]), int(k[i])
        rank = (float(score[o, a, k]), float(net[o, a, k]))
        if best is None or rank < best[0]:
            first = int(starts[a])
            where = (k, *window_owners(first, c, bool(o)))
            slots = [(int(r), k) for r, cut_here in zip(at[a], clear[o, a, :, k], strict=True) if cut_here]
            best = (rank, where, slots)
    if best is None:
        return None
    return best[1], best[2]
