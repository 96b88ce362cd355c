"""Filling cells to the last token (:func:`fill_cells`, phase C of :func:`~cpdata.schedule.balance.place_step`),
and first-fit decreasing (:func:`first_fit`, :func:`fits`), the planner's rescue placement and commit check.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter

import numpy as np

__all__ = ["ENDGAME", "EXACT_TRIES", "fill_cells", "first_fit", "fits"]

ENDGAME = 8
"""Phase C tries to close a cell exactly once its room is at most this many of the shortest fillers."""
EXACT_TRIES = 8
"""Phase C tries to close a nearly full cell exactly with one filler plus up to this many of the shortest."""


def first_fit(sizes: list[int], room: list[int], ids: list[int]) -> list[tuple[int, int]]:
    """First-fit decreasing (ties: the lower id): ``[(id, cell), ...]`` for the pieces that fit, ``room`` updated
    in place; a piece that fits nowhere is skipped."""
    out = []
    for s, i in sorted(zip(sizes, ids, strict=True), key=lambda p: (-p[0], p[1])):
        for c, r in enumerate(room):
            if r >= s:
                room[c] = r - s
                out.append((i, c))
                break
    return out


def fits(sizes: np.ndarray, cells: int, capacity: int) -> bool:
    """Whether :func:`first_fit` places every piece of ``sizes`` into ``cells`` empty cells (shortcut: at most
    ``cells`` pieces over a quarter cell, totalling at most three quarters of the cells, always fit)."""
    n = int(sizes.shape[0])
    if n <= cells:
        return True
    total = int(sizes.sum())
    if total > cells * capacity:
        return False
    if 4 * total <= 3 * cells * capacity and int((4 * sizes > capacity).sum()) <= cells:
        return True
    return len(first_fit(sizes.tolist(), [capacity] * cells, list(range(n)))) == n


def _exact(sizes: list[int], counts: dict[int, int], distinct: list[int], r: int) -> list[int] | None:
    """Positions in ``sizes`` (sorted; ``counts`` its histogram, ``distinct`` its sorted keys) of fillers summing
    to exactly ``r``: one filler, two, or one plus ``k < EXACT_TRIES`` of the shortest; None if none does."""
    last = lambda x: bisect_right(sizes, x) - 1  # noqa: E731  (the last of equal lengths: overdue ones)
    if counts.get(r):
        return [last(r)]
    for a in distinct[bisect_left(distinct, r - distinct[-1]) :]:  # a pair's shorter: r - longest on
        b = r - a
        if b < a:
            break
        if counts.get(b) and (b != a or counts[a] >= 2):
            i = last(a)
            return [i - 1, i] if a == b else [i, last(b)]
    sm = sizes[0]
    n_sm = counts[sm]
    for k in range(2, min(EXACT_TRIES, r // sm + 1)):
        t = r - k * sm
        if t > sm and counts.get(t) and n_sm >= k:
            return [last(t), *range(n_sm - k, n_sm)]
    return None


def fill_cells(cell, fill, slot, key, room_l, load_l, smax_l, dp_size) -> None:
    """Phase C, the lists updated in place: in rounds, each cell (largest gap below its slot's costliest first)
    takes the longest filler that fits, or closes exactly (:func:`_exact`) once nearly full, leaving no gap
    shorter than every filler where avoidable."""
    ids, sizes, keys = fill.tolist(), slot[fill].tolist(), key.tolist()
    counts = Counter(sizes)
    distinct = list(counts)  # ascending, as ``sizes``
    active = [c for c in range(len(room_l)) if room_l[c] >= sizes[0]]

    def place(c: int, i: int, size: int) -> None:
        if counts[size] > 1:  # count it out, and out of ``distinct`` when it was the last of its size
            counts[size] -= 1
        else:
            del counts[size]
            del distinct[bisect_left(distinct, size)]
        cell[i] = c
        room_l[c] -= size
        load_l[c] += keys[i]
        m = c // dp_size  # cell c is in slot c // dp_size
        smax_l[m] = max(smax_l[m], load_l[c])

    while sizes and active:
        gaps = [load_l[c] - smax_l[c // dp_size] for c in active]  # stable: ties keep the last round's order
        active = [active[j] for j in sorted(range(len(active)), key=gaps.__getitem__)]
        n_act = len(active)
        if len(sizes) > n_act and min(room_l[c] for c in active) >= max(sizes[-1] + sizes[0],
                                                                         ENDGAME * sizes[0] + 1):  # fmt: skip
            # Every cell has room for the longest and one more, and is far from closing: cell t of the round
            # takes the t-th longest (what the loop below would pick), so take them from the back at once.
            take_i, take_s = ids[-n_act:], sizes[-n_act:]
            del ids[-n_act:], sizes[-n_act:]
            for c, i, size in zip(active, reversed(take_i), reversed(take_s), strict=True):
                place(c, i, size)
            continue
        still = []
        for c in active:
            r = room_l[c]
            picks = _exact(sizes, counts, distinct, r) if r <= ENDGAME * sizes[0] else None
            if picks is None:
                j = bisect_right(sizes, r) - 1
                if j < 0:
                    continue
                if 0 < r - sizes[j] < sizes[0]:  # would strand a gap nothing fills: leave room for one more
                    j2 = bisect_right(sizes, r - sizes[0]) - 1
                    if j2 >= 0:
                        j = j2
                picks = [j]
            for j in sorted(picks, reverse=True) if len(picks) > 1 else picks:  # from the back: positions hold
                place(c, ids.pop(j), sizes.pop(j))
            if not sizes:
                break
            if room_l[c] >= sizes[0]:
                still.append(c)
        active = still
