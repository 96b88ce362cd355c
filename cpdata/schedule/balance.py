"""One step of the schedule: place a pool of pieces into ``dp_size x micro_batches`` packs, cost-balanced.

Cell ``(m, r)`` is micro-batch ``m`` of DP rank ``r``; the ranks run micro-batch ``m`` in lock-step, so what
counts per *slot* ``m`` is its costliest cell. A. outliers (over half a pack) in runs of similar length, one slot
each (:func:`~cpdata.schedule.runs.choose_runs`); B. the other long pieces, largest first, into the largest gap
below their slot's costliest cell; B'. exchanges between cells (:func:`~cpdata.schedule.improve.improve_step`)
where attention can dominate a pack; C. fillers close every cell (:func:`~cpdata.schedule.fill.fill_cells`).
The balancing key is ``b * L**2`` when the step is full (the linear parts are then equal), the whole cost for a
short last step. Pieces that fit nowhere are returned unplaced.
"""

from __future__ import annotations

from bisect import insort

import numpy as np

from cpdata.schedule.fill import fill_cells, first_fit
from cpdata.schedule.improve import improve_step
from cpdata.schedule.runs import choose_runs

__all__ = ["FILLER_FRACTION", "place_step"]

FILLER_FRACTION = 16
"""Pieces of at most ``capacity / FILLER_FRACTION`` slot tokens are fillers (phase C)."""
def place_step(
    slot: np.ndarray,
    key: np.ndarray,
    forced: np.ndarray,
    age: np.ndarray,
    *,
    capacity: int,
    dp_size: int,
    micro_batches: int,
    hold: bool,
    full_cost: float,
    quad: float,
    first: tuple[np.ndarray, ...] = (),
    runs: tuple[list[np.ndarray], list[int]] | None = None,
) -> np.ndarray:
    """int64 ``[n]``: the cell ``m * dp_size + r`` of every piece of one step's pool, ``-1`` for unplaced ones.

    Per piece ``[n]``: ``slot`` tokens, balancing ``key``, ``forced`` (overdue), ``age``; ``full_cost`` scales
    :data:`~cpdata.schedule.runs.HOLD_PENALTY`, ``quad`` is ``b * capacity**2``. ``first`` (rescue): these
    groups (bool masks) go first, first-fit decreasing, and no runs are formed. ``runs``:
    :func:`choose_runs`'s decision, if made.
    """
    n, R, M, C = int(slot.shape[0]), dp_size, micro_batches, capacity
    K = R * M
    cell = np.full(n, -1, dtype=np.int64)
    room = np.full(K, C, dtype=np.int64)
    load = np.zeros(K, dtype=np.float64)

    if first:
        room_l = room.tolist()
        for group in first:
            due = np.flatnonzero(group & (cell < 0))
            for i, c in first_fit(slot[due].tolist(), room_l, due.tolist()):
                cell[i] = c
                load[c] += key[i]
        room = np.asarray(room_l, dtype=np.int64)
        forced = np.zeros_like(forced)
        hold = False
    todo = cell < 0

    # A. runs of outliers, one per rank, in slots 0, 1, ...
    if runs is None or first:
        runs = choose_runs(slot, key, forced & todo, age, todo, capacity=C, dp_size=R, slots=0 if first else M,
                           hold=hold, full_cost=full_cost, quad=quad)  # fmt: skip
    runs, loose = runs
    for j, run in enumerate(runs):
        cells = j * R + (np.arange(R) if j % 2 == 0 else np.arange(R - 1, -1, -1))  # odd runs: ranks reversed
        cell[run] = cells
        room[cells] -= slot[run]
        load[cells] += key[run]

    # B. overdue long pieces first, then the others (longest first), each into the largest gap; the
    # others leave room for the overdue fillers (with K * C / FILLER_FRACTION spare, every filler fits).
    is_filler = slot * FILLER_FRACTION <= C
    long_ = np.concatenate([np.flatnonzero(~is_filler & (2 * slot <= C) & todo), np.asarray(loose, dtype=np.int64)])
    first = long_[forced[long_]]
    rest = long_[~forced[long_]]
    overdue_fill = np.flatnonzero(is_filler & forced & todo)
    reserve = int(slot[overdue_fill].sum()) + (K * C) // FILLER_FRACTION if overdue_fill.size else 0
    room_l, load_l, smax_l = room.tolist(), load.tolist(), load.reshape(M, R).max(axis=1).tolist()
    # Per slot, its cells by load ascending (the first that fits has the slot's largest gap), without those with
    # less room than the shortest piece of phase B.
    min_b = int(slot[long_].min()) if long_.size else 0
    by_load = [sorted((c for c in range(m * R, (m + 1) * R) if room_l[c] >= min_b), key=lambda c: (load_l[c], c))
               for m in range(M)]  # fmt: skip
    free = sum(room_l)
    shortest = int(slot[todo].min()) if todo.any() else 0
    scale = 1 + 1e-6
    neg_inf = -np.inf
    gaps = [smax_l[m] - load_l[cells_m[0]] * scale if cells_m else neg_inf for m, cells_m in enumerate(by_load)]
    visit = [(m, *range(m), *range(m + 1, M)) for m in range(M)]  # the largest gap's slot first, then in order
    for ids, keep in ((first, 0), (rest, reserve)):
        ids = ids[np.lexsort((ids, -slot[ids]))]
        for i, s, k in zip(ids.tolist(), slot[ids].tolist(), key[ids].tolist(), strict=True):
            if free - s < keep:
                continue
            top = max(gaps)
            if top == neg_inf:  # no cell has room for any piece of phase B
                break
            m_top = gaps.index(top)
            best = by_load[m_top][0]  # fast path: the largest gap takes it without stranding one
            left = room_l[best] - s
            if left < 0 or 0 < left < shortest:
                best = -1
            # Else per slot the first cell (by load) with room, the largest gap wins (ties: the emptier cell, then
            # the lower slot); a slot whose largest gap cannot win is skipped. First avoid stranding a gap shorter
            # than any piece.
            for strand_ok in (False, True) if best < 0 else ():
                best_gap, best_m = neg_inf, M
                for m in visit[m_top]:
                    g = gaps[m]
                    if g < best_gap or (g == best_gap and m > best_m):
                        continue
                    for c in by_load[m]:
                        left = room_l[c] - s
                        if left >= 0 and (strand_ok or left == 0 or left >= shortest):
                            gap = smax_l[m] - load_l[c] * scale
                            if gap > best_gap or (gap == best_gap and m < best_m):
                                best, best_gap, best_m = c, gap, m
                            break
                if best >= 0:
                    break
            if best < 0:
                continue
            cell[i] = best
            room_l[best] -= s
            free -= s
            load_l[best] += k
            m = best // R
            smax_l[m] = max(smax_l[m], load_l[best])
            cells_m = by_load[m]  # ``best`` got heavier: placed again in (load, cell) order
            cells_m.remove(best)
            if room_l[best] >= min_b:
                insort(cells_m, best, key=lambda c: (load_l[c], c))
            gaps[m] = smax_l[m] - load_l[cells_m[0]] * scale if cells_m else neg_inf

    # B'. exchanges that lower the slots' costliest cells, where the attention part can dominate a pack.
    if quad * 2 >= full_cost:
        fillers = is_filler & todo & (cell < 0)
        f_tok = int(slot[fillers].sum())
        rho = float(key[fillers].sum()) / f_tok if f_tok else 0.0
        room_a, load_a = np.asarray(room_l, dtype=np.int64), np.asarray(load_l, dtype=np.float64)
        if improve_step(cell, (cell >= 0) & (2 * slot <= C), slot, key, room_a, load_a, rho, R, M):
            room_l, load_l = room_a.tolist(), load_a.tolist()
            smax_l = [max(load_l[m * R : (m + 1) * R]) for m in range(M)]
    # C. fillers, overdue ones first: rounds in which each cell (largest gap first) takes the longest that fits.
    for fill in (overdue_fill, np.flatnonzero(is_filler & ~forced & todo)):
        if fill.size:
            fill = fill[np.lexsort((fill, slot[fill]))]  # ascending
            fill_cells(cell, fill, slot, key, room_l, load_l, smax_l, R)
    return cell
