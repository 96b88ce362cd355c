"""One step of the schedule: place a pool of pieces into ``dp_size x micro_batches`` packs, cost-balanced.

A step has ``K = dp_size * micro_batches`` cells (packs) of ``capacity``
tokens; cell ``(m, r)`` is micro-batch ``m`` of DP rank ``r``. The ranks run
micro-batch ``m`` in lock-step (FSDP / ZeRO-3 / pipeline), so the cost that
counts is, per micro-batch *slot* ``m``, the largest cell cost of the slot.
The placement makes the cells of one slot equally costly and every cell full:

A. *Runs of outliers.* Pieces longer than half a pack (at most one per cell)
   are sorted by length; a dynamic program (:func:`~cpdata.schedule.runs.choose_runs`)
   cuts them into runs of ``dp_size`` neighbours, one slot each, one piece per
   rank (snake order across runs, so no rank collects every run's largest). A
   run costs its spread in "effective" quadratic cost (a piece's own plus the
   most its cell's leftover room can add); an outlier can instead wait for
   partners of its size (``hold``: not yet overdue; cost :data:`HOLD_PENALTY`
   of a full cell per step of age) or go loose into phase B (cost: what the
   cells of its slot cannot match without an outlier). At most
   ``micro_batches`` runs, fewer when overdue outliers need slots of their own.
B. *Largest first into the largest gap.* The other pieces longer than
   ``capacity / FILLER_FRACTION``, overdue ones first, then by length
   descending, each go to the cell whose balancing key is furthest below its
   slot's largest, among the cells with room (ties: the emptier cell, then the
   lower slot). The not-overdue ones leave room for the overdue fillers.
B'. *Exchanges* (:func:`~cpdata.schedule.improve.improve_step`), when the
   attention part of a full pack (``b * capacity**2``) is at least half its
   cost: phase B never takes a piece back, so pieces of at most half a pack
   are exchanged or moved between cells (any slot) while that lowers the sum
   of the slots' costliest cells (D2 at dp 8 with ``max_delay=4``: ``imb_mb``
   2.56 -> 2.16 % over 12 sampling seeds, for a small share of the planning
   time). At 8K under the 7B model the linear part dominates and slots are
   within 0.5 % already: there (D1) the pass gained 0.005 pp for several
   times the planning time (docs/benchmarks.md), so it is skipped.
C. *Fillers.* The short pieces (overdue ones first) fill the remaining room
   in rounds: each round, cells in order of their gap take the longest filler
   that fits, or a shorter one when the longest would strand a gap smaller
   than every filler; so cells end within a few tokens of full.

The balancing key is a cell's quadratic cost ``b * sum L**2`` when the step is
full (then every cell ends with ``capacity`` tokens, the linear parts are
equal, and only the quadratic part can differ), and its whole cost for a
short (last) step. Pieces that fit nowhere are returned unplaced (the caller
carries them to the next step).
"""

from __future__ import annotations

import numpy as np

from cpdata.schedule.fill import fill_cells, first_fit
from cpdata.schedule.improve import improve_step
from cpdata.schedule.runs import HOLD_PENALTY, choose_runs

__all__ = ["FILLER_FRACTION", "HOLD_PENALTY", "choose_runs", "place_step"]

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
    """Place one step's pool.

    Args:
        slot: int64 ``[n]`` slot tokens per piece (each ``<= capacity``), any order.
        key: float64 ``[n]`` balancing key per piece (see the module docstring).
        forced: bool ``[n]`` pieces that must be placed in this step (overdue).
        hold: outliers without a run of their size may stay unplaced (``max_delay > 0``).
        age: int64 ``[n]`` steps each piece has waited.
        full_cost: the cost of a full cell, the scale of :data:`HOLD_PENALTY`.
        quad: the quadratic cost of one piece of ``capacity`` tokens (``b * capacity**2``).
        first: rescue mode: these groups of pieces (bool ``[n]`` masks) go first, group by group,
            first-fit decreasing (:func:`~cpdata.schedule.fill.first_fit`) into the empty cells; no runs
            are formed and the rest fills around them. The planner gives the overdue pieces, then those
            due next step, so a group that passed :func:`~cpdata.schedule.fill.fits` is placed whole.
        runs: phase A's decision if already made by :func:`choose_runs` on these very arguments
            (with ``slots=micro_batches``; the planner's intake makes it to size the pool).

    Returns:
        int64 ``[n]``: cell ``m * dp_size + r`` of every piece, ``-1`` for unplaced ones.
    """
    n, R, M, C = int(slot.shape[0]), dp_size, micro_batches, capacity
    K = R * M
    cell = np.full(n, -1, dtype=np.int64)
    room = np.full(K, C, dtype=np.int64)
    load = np.zeros(K, dtype=np.float64)
    slot_of = np.arange(K, dtype=np.int64) // R

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
        ranks = np.arange(R) if j % 2 == 0 else np.arange(R - 1, -1, -1)
        cells = j * R + ranks
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
    smax = np.zeros(M, dtype=np.float64)
    np.maximum.at(smax, slot_of, load)
    room_l, load_l, smax_l = room.tolist(), load.tolist(), smax.tolist()
    # Per slot, its cells by load ascending: the first that fits has the slot's largest gap.
    by_load = [sorted(range(m * R, (m + 1) * R), key=lambda c: (load_l[c], c)) for m in range(M)]
    free = sum(room_l)
    shortest = int(slot[todo].min()) if todo.any() else 0
    scale = 1 + 1e-6
    # Per slot, the largest gap (its lightest cell's): no other cell of any slot has a larger one.
    # Cells with less room than the shortest piece of phase B leave the lists (they take none of them).
    min_b = int(slot[long_].min()) if long_.size else 0
    by_load = [[c for c in cells_m if room_l[c] >= min_b] for cells_m in by_load]
    neg_inf = -np.inf
    gaps = [smax_l[m] - load_l[cells_m[0]] * scale if cells_m else neg_inf for m, cells_m in enumerate(by_load)]
    visit = [(m, *range(m), *range(m + 1, M)) for m in range(M)]  # the largest gap's slot first, then in order
    placed_i: list[int] = []
    placed_c: list[int] = []
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
            placed_i.append(i)
            placed_c.append(best)
            room_l[best] -= s
            free -= s
            load_l[best] += k
            m = best // R
            if load_l[best] > smax_l[m]:
                smax_l[m] = load_l[best]
            cells_m = by_load[m]  # ``best`` got heavier: move it right to keep (load, cell) order
            j = cells_m.index(best)
            if room_l[best] < min_b:
                del cells_m[j]
            else:
                lb, last = load_l[best], len(cells_m) - 1
                while j < last:
                    nxt = cells_m[j + 1]
                    ln = load_l[nxt]
                    if ln > lb or (ln == lb and nxt > best):
                        break
                    cells_m[j] = nxt
                    j += 1
                cells_m[j] = best
            gaps[m] = smax_l[m] - load_l[cells_m[0]] * scale if cells_m else neg_inf
    if placed_i:
        cell[np.asarray(placed_i, dtype=np.int64)] = np.asarray(placed_c, dtype=np.int64)

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
            fill_cells(cell, fill, slot, key, room_l, load_l, smax_l, slot_of.tolist())
    return cell
