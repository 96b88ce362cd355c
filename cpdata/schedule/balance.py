"""One step of the schedule: place a pool of pieces into ``dp_size x micro_batches`` packs, cost-balanced.

A step has ``K = dp_size * micro_batches`` cells (packs) of ``capacity``
tokens; cell ``(m, r)`` is micro-batch ``m`` of DP rank ``r``. The ranks run
micro-batch ``m`` in lock-step (FSDP / ZeRO-3 / pipeline), so the cost that
counts is, per micro-batch *slot* ``m``, the largest cell cost of the slot.
The placement makes the cells of one slot equally costly and every cell full:

A. *Runs of outliers.* Pieces longer than half a pack (at most one per cell)
   are sorted by length; a dynamic program (:func:`choose_runs`) cuts them
   into runs of ``dp_size`` neighbours, one slot each, one piece per rank
   (snake order across runs, so no rank collects every run's largest). A run
   costs its spread in "effective" quadratic cost (a piece's own plus the most
   its cell's leftover room can add); an outlier can instead wait for partners
   of its size (``hold``: not yet overdue; cost :data:`HOLD_PENALTY` of a full
   cell per step of age) or go loose into phase B (cost: what the cells of
   its slot cannot match without an outlier). At most ``micro_batches`` runs,
   fewer when overdue outliers need slots of their own.
B. *Largest first into the largest gap.* The other pieces longer than
   ``capacity / FILLER_FRACTION``, overdue ones first, then by length
   descending, each go to the cell whose balancing key is furthest below its
   slot's largest, among the cells with room (ties: the emptier cell, then the
   lower slot). The not-overdue ones leave room for the overdue fillers.
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

from bisect import bisect_right, insort

import numpy as np

__all__ = ["FILLER_FRACTION", "HOLD_PENALTY", "choose_runs", "place_step"]

FILLER_FRACTION = 16
"""Pieces of at most ``capacity / FILLER_FRACTION`` slot tokens are fillers (phase C)."""
ENDGAME = 4
"""Phase C tries to close a cell exactly once its room is at most this many of the shortest fillers."""
EXACT_TRIES = 8
"""Phase C tries to close a nearly full cell exactly with one filler plus up to this many of the shortest."""
HOLD_PENALTY = 0.01
"""Cost of letting an outlier wait one more step, as a share of a full cell's cost, times (1 + its age)."""


def _runs(
    order: np.ndarray, ek: np.ndarray, forced: np.ndarray, age: np.ndarray, *, dp_size: int, slots: int,
    hold: bool, full_cost: float, flex: float,
) -> tuple[list[np.ndarray], list[int]]:
    """Choose runs among outliers (indices ``order``, longest first) by dynamic programming.

    Each outlier either joins a run of ``dp_size`` neighbours in length order
    (cost: the run's spread, ``sum(ek[top] - ek[j])``), waits (``hold`` and not
    overdue; cost grows with its age) or goes loose to phase B (cost: what the
    flexible cells of its slot cannot match, ``(dp_size - 1) * (ek - flex)``).
    At most ``slots`` runs. Returns the runs and the loose pieces; the rest wait.
    """
    n, R = int(order.shape[0]), dp_size
    e = ek[order]
    pre = np.concatenate([[0.0], np.cumsum(e)]).tolist()
    el = e.tolist()
    loose_cost = [(R - 1) * max(0.0, x - flex) for x in el]
    wait_cost = [HOLD_PENALTY * full_cost * (1 + int(a)) if hold and not f else np.inf
                 for a, f in zip(age[order].tolist(), forced[order].tolist(), strict=True)]  # fmt: skip
    inf = float("inf")
    # best[i][k]: least cost for pieces i.. with k runs still allowed; choice[i][k]: 0 single, 1 run
    best = [[0.0] * (slots + 1) for _ in range(n + 1)]
    choice = [[0] * (slots + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        single = min(loose_cost[i], wait_cost[i])
        for k in range(slots + 1):
            b = single + best[i + 1][k]
            c = 0
            if k and i + R <= n:
                run = R * el[i] - (pre[i + R] - pre[i]) + best[i + R][k - 1]
                if run < b:
                    b, c = run, 1
            best[i][k] = b if b < inf else inf
            choice[i][k] = c
    runs: list[np.ndarray] = []
    loose: list[int] = []
    i, k = 0, slots
    while i < n:
        if choice[i][k]:
            runs.append(order[i : i + R])
            i, k = i + R, k - 1
        else:
            if loose_cost[i] <= wait_cost[i]:
                loose.append(int(order[i]))
            i += 1
    return runs, loose


def choose_runs(
    slot: np.ndarray, key: np.ndarray, forced: np.ndarray, age: np.ndarray, todo: np.ndarray, *, capacity: int,
    dp_size: int, slots: int, hold: bool, full_cost: float, quad: float,
) -> tuple[list[np.ndarray], list[int]]:
    """Phase A's decision alone: ``(runs, loose)`` among the outliers of ``todo``; the other outliers wait.

    The planner calls it before a step to learn how many tokens will wait (and take more pieces instead).
    """
    C, R = capacity, dp_size
    outlier = np.flatnonzero((2 * slot > C) & todo)
    by_len = outlier[np.lexsort((outlier, -slot[outlier]))]
    b = quad / float(C) ** 2
    ek = key.copy()
    ek[by_len] += b * (C - slot[by_len]).astype(np.float64) ** 2  # the most a cell's room can still add
    # Overdue outliers that end up loose need cells without a run: keep ceil(overdue / R) slots free.
    slots = max(0, slots - (-(-int(forced[outlier].sum()) // R)))
    return _runs(by_len, ek, forced, age, dp_size=R, slots=slots, hold=hold, full_cost=full_cost, flex=quad / 2)


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
    overdue_first: bool = False,
    occupied: tuple[np.ndarray, np.ndarray] | None = None,
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
        overdue_first: rescue mode: the overdue pieces go first, first-fit decreasing into the empty
            cells, and no runs are formed (every overdue piece fits when they hold at most half a step).
        occupied: ``(room, load)`` per cell of pieces placed before (a refill of a step with room left):
            the pool then goes into what is left, without runs.

    Returns:
        int64 ``[n]``: cell ``m * dp_size + r`` of every piece, ``-1`` for unplaced ones.
    """
    n, R, M, C = int(slot.shape[0]), dp_size, micro_batches, capacity
    K = R * M
    cell = np.full(n, -1, dtype=np.int64)
    room = np.full(K, C, dtype=np.int64) if occupied is None else occupied[0].copy()
    load = np.zeros(K, dtype=np.float64) if occupied is None else occupied[1].copy()
    slot_of = np.arange(K, dtype=np.int64) // R

    if overdue_first:
        due = np.flatnonzero(forced)
        for i in due[np.lexsort((due, -slot[due]))].tolist():
            fits = np.flatnonzero(room >= slot[i])
            if fits.size:
                c = int(fits[0])
                cell[i], room[c], load[c] = c, room[c] - slot[i], load[c] + key[i]
        forced = np.zeros_like(forced)
        hold = False
    todo = cell < 0

    # A. runs of outliers, one per rank, in slots 0, 1, ...
    slots = 0 if overdue_first or occupied is not None else M
    runs, loose = choose_runs(slot, key, forced & todo, age, todo, capacity=C, dp_size=R, slots=slots, hold=hold,
                              full_cost=full_cost, quad=quad)  # fmt: skip
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
    for ids, keep in ((first, 0), (rest, reserve)):
        ids = ids[np.lexsort((ids, -slot[ids]))]
        for i, s, k in zip(ids.tolist(), slot[ids].tolist(), key[ids].tolist(), strict=True):
            if free - s < keep:
                continue
            best, best_gap = -1, -np.inf
            for strand_ok in (False, True):  # first avoid leaving a gap shorter than every piece
                for m in range(M):
                    for c in by_load[m]:
                        left = room_l[c] - s
                        if left >= 0 and (strand_ok or left == 0 or left >= shortest):
                            gap = smax_l[m] - load_l[c] * (1 + 1e-6)  # ties: the emptier cell, then the lower slot
                            if gap > best_gap:
                                best, best_gap = c, gap
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
            if load_l[best] > smax_l[m]:
                smax_l[m] = load_l[best]
            cells_m = by_load[m]
            cells_m.remove(best)
            insort(cells_m, best, key=lambda c: (load_l[c], c))

    # C. fillers, overdue ones first: rounds in which each cell (largest gap first) takes the longest that fits.
    for fill in (overdue_fill, np.flatnonzero(is_filler & ~forced & todo)):
        if fill.size:
            fill = fill[np.lexsort((fill, slot[fill]))]  # ascending
            _fill(cell, fill, slot, key, room_l, load_l, smax_l, slot_of.tolist())
    return cell


def _exact(sizes: list[int], counts: dict[int, int], r: int, tries: int = EXACT_TRIES) -> list[int] | None:
    """Positions in ``sizes`` (sorted; ``counts`` its histogram) of fillers summing to exactly ``r``: one
    filler, two, or one plus ``k < tries`` of the shortest; None if none of these does."""
    last = lambda x: bisect_right(sizes, x) - 1  # noqa: E731  (the last of equal lengths: overdue ones)
    if counts.get(r):
        return [last(r)]
    for a in counts:  # ascending (built from sorted lengths, deletions keep the order)
        b = r - a
        if b < a:
            break
        if counts.get(b) and (b != a or counts[a] >= 2):
            i = last(a)
            return [i - 1, i] if a == b else [i, last(b)]
    sm = sizes[0]
    n_sm = counts[sm]
    for k in range(2, min(tries, r // sm + 1)):
        t = r - k * sm
        if t > sm and counts.get(t) and n_sm >= k:
            return [last(t), *range(n_sm - k, n_sm)]
    return None


def _fill(cell, fill, slot, key, room_l, load_l, smax_l, slot_of_l) -> None:
    """Phase C: in rounds, each cell (largest gap first) takes the longest filler that fits (lists updated).

    A cell whose room is at most ``ENDGAME`` shortest fillers is first closed exactly if it can be
    (:func:`_exact`): by one filler, two, or one plus copies of the shortest.
    """
    ids, sizes, keys = fill.tolist(), slot[fill].tolist(), key.tolist()
    counts: dict[int, int] = {}
    for x in sizes:
        counts[x] = counts.get(x, 0) + 1
    active = [c for c in range(len(room_l)) if room_l[c] >= sizes[0]]
    while sizes and active:
        active.sort(key=lambda c: load_l[c] - smax_l[slot_of_l[c]])
        still = []
        for c in active:
            r = room_l[c]
            picks = _exact(sizes, counts, r) if r <= ENDGAME * sizes[0] else None
            if picks is None:
                j = bisect_right(sizes, r) - 1
                if j < 0:
                    continue
                if 0 < r - sizes[j] < sizes[0]:  # would strand a gap nothing fills: leave room for one more
                    j2 = bisect_right(sizes, r - sizes[0]) - 1
                    if j2 >= 0:
                        j = j2
                picks = [j]
            m = slot_of_l[c]
            for j in sorted(picks, reverse=True):  # pop from the back: earlier positions stay valid
                i = ids.pop(j)
                size = sizes.pop(j)
                counts[size] -= 1
                if not counts[size]:
                    del counts[size]
                room_l[c] -= size
                cell[i] = c
                load_l[c] += keys[i]
            if load_l[c] > smax_l[m]:
                smax_l[m] = load_l[c]
            if not sizes:
                break
            if room_l[c] >= sizes[0]:
                still.append(c)
        active = still
